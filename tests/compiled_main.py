"""Run a test module's ``_main`` in a subprocess without ``TRITON_INTERPRET`` (Triton's
compiler needs JITFunctions, which the interpreter replaces) and read the JSON it prints
last: how the sm90 codegen tests compile kernels on a machine without a GPU."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_main(module_file: str, timeout: int = 600):
    """``python module_file`` with the checkout on ``PYTHONPATH``; its last stdout line as
    JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(module_file)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
