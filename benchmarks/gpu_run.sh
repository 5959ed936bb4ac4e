#!/usr/bin/env bash
# One batch on a GPU machine: local wheels, GPU tests, self-check, benchmarks; logs and CSVs
# to $COMPILEOPS_BENCH_OUT (default benchmarks/out).
#   bash benchmarks/gpu_run.sh [family ...]     (default: every bench_*.py)
# Wheels in .whl/ (for a machine without a package index) are installed first; it never
# installs from a registry.
set -uo pipefail
OUT=${COMPILEOPS_BENCH_OUT:-benchmarks/out}
export COMPILEOPS_BENCH_OUT=$OUT
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
families=("$@")
[ ${#families[@]} -eq 0 ] && families=($(ls benchmarks/bench_*.py | sed 's#benchmarks/bench_##; s#\.py##'))
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.log"
tests=()
for f in "${families[@]}"; do [ -d "tests/$f" ] && tests+=("tests/$f"); done
timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
timeout 200 python3 -m compileops 2>&1 | tee "$OUT/selfcheck.log" | grep -v Warning
for f in "${families[@]}"; do
  args_var="BENCH_ARGS_$f"
  timeout 400 python3 benchmarks/bench_$f.py ${!args_var:-} 2>&1 | tee "$OUT/bench_$f.log" | grep -v -i warn
done
