"""``import compileops`` is cheap, and lowerings install themselves before the first compile."""
import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_is_cheap_and_does_not_load_inductor():
    out = _run(
        """
        import sys, time
        import torch
        start = time.perf_counter()
        import compileops
        cost = time.perf_counter() - start
        heavy = [m for m in ("torch._inductor.lowering", "triton") if m in sys.modules]
        print(cost)
        print(",".join(heavy))
        print(hasattr(torch.ops.compileops, "embedding_backward"))
        """
    )
    cost, heavy, registered = out.split("\n")[:3]
    assert float(cost) < 0.3, f"import compileops took {float(cost):.3f}s over import torch"
    assert heavy == "", f"import compileops loaded {heavy}"
    assert registered == "True"


def test_lowerings_installed_automatically_before_first_compile():
    out = _run(
        """
        import torch, compileops
        from compileops import lowerings
        assert not lowerings.is_installed()
        f = torch.compile(lambda i, w: compileops.embedding(i, w) * 2, fullgraph=True)
        f(torch.tensor([1, 2]), torch.randn(4, 3))
        from torch._inductor.lowering import lowerings as table
        print(lowerings.is_installed(), torch.ops.compileops.embedding.default in table)
        """
    )
    assert out.split() == ["True", "True"]


def test_install_is_idempotent_and_safe_when_inductor_already_loaded():
    out = _run(
        """
        import torch._inductor.lowering
        import compileops
        from compileops import lowerings
        print(lowerings.is_installed())
        lowerings.install(); lowerings.install()
        print(lowerings.is_installed())
        """
    )
    assert out.split() == ["True", "True"]
