"""``import compileops`` loads nothing heavy, and the lowerings install themselves before the
first compile."""
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
    """``import compileops`` after ``import torch`` loads compileops' own modules and nothing
    else outside the standard library: not Inductor's lowering table (seconds), Triton or transformers, which load when a
    compile, a kernel or an integration first needs them. (Checked by what is imported, not
    by a timing, which would depend on the machine's load.)"""
    out = _run(
        """
        import sys
        import torch
        before = set(sys.modules)
        import compileops
        loaded = sorted(m for m in set(sys.modules) - before
                        if m.split(".")[0] not in ("compileops", *sys.stdlib_module_names))
        print(",".join(loaded))
        print(hasattr(torch.ops.compileops, "embedding_backward"))
        """
    )
    loaded, registered = out.split("\n")[:2]
    assert loaded == "", f"import compileops also loaded {loaded}"
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


def test_a_checkout_on_pythonpath_works_without_installing():
    """A source checkout put on PYTHONPATH (no install, so no import hook maps lowerings/ to
    compileops.lowerings) still imports, and its lowerings install and compile."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    out = _run(
        f"""
        import sys
        # Drop an editable install's import hook, if any: this is a plain checkout.
        sys.meta_path = [f for f in sys.meta_path
                         if not getattr(f, "__module__", "").startswith("__editable__")]
        sys.path.insert(0, {str(root)!r})
        import torch, compileops
        import compileops.lowerings._compat
        from compileops import lowerings
        f = torch.compile(lambda i, w: compileops.embedding(i, w) * 2, fullgraph=True)
        f(torch.tensor([1, 2]), torch.randn(4, 3))
        print(lowerings.__file__.startswith({str(root / "lowerings")!r}),
              lowerings.is_installed(), sys.modules["compileops.lowerings"] is lowerings)
        """
    )
    assert out.split() == ["True", "True", "True"]
