"""Helpers shared by the grouped-linear tests. Tests never import ``benchmarks/``: what they
check of a benchmark script, they get by running it in a subprocess."""
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

import compileops
from compileops.grouped_linear import clear_fp8_weight_cache, reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEP = os.path.join(ROOT, "benchmarks", "tuning", "sweep_grouped_linear.py")

# Relative error against fp64 per dtype (the ops' stated precision).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def offsets_of(sizes):
    return torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)


def make_grouped(sizes, k, n, dtype=torch.float32, bias=True, extra_rows=0, seed=0):
    """``(x [M, k], w [G, n, k], offsets, b [G, n] or None)`` for groups of ``sizes`` rows and
    ``extra_rows`` tail rows."""
    gen = torch.Generator().manual_seed(seed)
    m = sum(sizes) + extra_rows
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(len(sizes), n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(len(sizes), n, generator=gen).to(dtype) if bias else None
    return x, w, offsets_of(sizes), b


def make_expert_inputs(sizes, k=16, n=24, extra_rows=2, seed=0):
    """``(x, w, offsets, b, p)`` for :func:`moe_expert`, fp32; ``p``: a router probability
    per row."""
    gen = torch.Generator().manual_seed(seed)
    m = sum(sizes) + extra_rows
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(len(sizes), n, k, generator=gen) / k**0.5
    b = torch.randn(len(sizes), n, generator=gen)
    p = torch.rand(m, generator=gen)
    return x, w, torch.cumsum(torch.tensor(sizes), 0).to(torch.int32), b, p


def moe_expert(x, w, offs, b, p):
    """Fused gate/up SwiGLU, then per-row router-probability scaling."""
    return compileops.grouped_linear_swiglu(x, w, offs, b) * p[:, None]


def grads_fp64(x, w, offs, b, grad):
    """``(y, dX, dW, db)`` of the reference forward in fp64, by autograd."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w)]
    bb = b.detach().double().requires_grad_() if b is not None else None
    y = reference.grouped_linear_forward(leaves[0], leaves[1], offs, bb)
    y.backward(grad.double())
    return y, leaves[0].grad, leaves[1].grad, (bb.grad if bb is not None else None)


# The sweep's M-jagged TMA-store configs (FWD_CONFIGS, also timed for dX, and
# SWIGLU_CONFIGS): case -> (product, Config args, Config kwargs), all with tma_store=True.
# Built for sm90 in test_codegen_sm90.py, run on the GPU in test_gpu.py; test_benchmarks.py
# checks they are the sweep's.
MJAGGED_STORE_VARIANTS = {
    "fwd-128x256-flat-tma-store": ("fwd", (128, 256, 64, 8, 3), dict(flatten=True)),
    "dx-128x256-flat-tma-store": ("dx", (128, 256, 64, 8, 3), dict(flatten=True)),
    "fwd-128x128-s2-flat-x2-tma-store": ("fwd", (128, 128, 64, 4, 2),
                                         dict(flatten=True, programs_per_sm=2)),
    "dx-128x128-s2-flat-x2-tma-store": ("dx", (128, 128, 64, 4, 2),
                                        dict(flatten=True, programs_per_sm=2)),
    "swiglu-128x128-flat-tma-store": ("swiglu", (128, 128, 64, 8, 3), dict(flatten=True)),
    "swiglu-128x128-tma-store": ("swiglu", (128, 128, 64, 8, 3), {}),
}


def mjagged_store_config(case):
    """``(product, Config)`` of a :data:`MJAGGED_STORE_VARIANTS` case."""
    from compileops.grouped_linear.kernels import Config

    product, args, kwargs = MJAGGED_STORE_VARIANTS[case]
    return product, Config(*args, tma_store=True, **kwargs)


def mjagged_store_configs(product):
    """The :data:`MJAGGED_STORE_VARIANTS` configs of ``product`` (fwd, dx or swiglu)."""
    return [mjagged_store_config(case)[1] for case, (p, _, _) in MJAGGED_STORE_VARIANTS.items()
            if p == product]


@functools.lru_cache(maxsize=None)
def sweep_listing():
    """``benchmarks/tuning/sweep_grouped_linear.py --list-configs``: per pass the configs it
    times (``{"config": fields, "label": ...}``), and per benchmark shape the dW labels
    against that shape's default (run once per session, in a subprocess, no GPU)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, SWEEP, "--list-configs"], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sweep_configs(kind):
    """``[(Config, label)]`` the sweep times for ``kind`` (fwd, swiglu, dW, "dW no db")."""
    from compileops.grouped_linear.kernels import Config

    return [(Config(**e["config"]), e["label"]) for e in sweep_listing()[kind]]


def template_source(fn, *args, dynamic, with_imports=False):
    """The grouped-linear template kernel Inductor writes for ``fn(*args)`` (Triton codegen on
    this CPU): its decorator and body as in the generated module, after the imports it needs
    when ``with_imports``."""
    from compileops.lowerings import _compat

    torch._dynamo.reset()
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        _, sources = _compat.run_and_get_code(torch.compile(fn, fullgraph=True, dynamic=dynamic),
                                              *args)
    code = "\n".join(sources)
    start = code.index("def triton_tem_")
    begin = (code.rindex("'''", 0, start) + 3 if with_imports
             else code.rindex("@triton_heuristics", 0, start))
    return code[begin:code.index("''', device_str", start)]


def record_triton_launches(monkeypatch) -> list:
    """The names of the Triton kernels launched from now on, in order (a list that grows).
    Under the interpreter only, whose launches all pass through ``InterpretedFunction.run``."""
    from triton.runtime.interpreter import InterpretedFunction

    names = []
    run = InterpretedFunction.run

    def recording_run(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    return names


@pytest.fixture
def empty_fp8_cache():
    """The fp8 weight cache empty before and after the test (import it into a test module
    with ``pytestmark = pytest.mark.usefixtures("empty_fp8_cache")``)."""
    clear_fp8_weight_cache()
    yield
    clear_fp8_weight_cache()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def kernel_device(request):
    """Where a Triton kernel test runs: CPU tensors (under ``TRITON_INTERPRET=1`` only; skipped
    otherwise) and, marked ``gpu``, CUDA."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if request.param == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on CPU tensors under TRITON_INTERPRET=1 only")
    return request.param
