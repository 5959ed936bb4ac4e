"""benchmarks/bench_xlstm_hf.py switches one model between implementations in place: back on
the native code, no compileops forward may stay behind (the native rows would time compileops).
A subprocess, as tests never import ``benchmarks/``."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", minversion="5.7")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CODE = """
import benchmarks.bench_xlstm_hf as bench
from compileops.integrations._forward import bound_function
from transformers import xLSTMConfig, xLSTMForCausalLM

model = xLSTMForCausalLM(xLSTMConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1,
                                     num_heads=2))
state = {"native_backends": [layer.mlstm_backend for layer in bench._layers(model)]}
counts = []
for impl in ("compileops", "native", "compileops"):
    bench.use(model, impl, state)
    counts.append(sum(bound_function(m) is not None for m in model.modules()))
print(*counts)
"""


def test_switching_back_to_native_drops_every_compileops_forward():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", CODE], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    patched, native, again = map(int, proc.stdout.split())
    assert patched == again == 1 + 1 + 2 + 1  # the layer, the model, 3 RMSNorms
    assert native == 0
