"""Run transformers' own model tests twice, plain and with compileops switched on, and compare.

Opt-in (it needs a transformers source checkout, whose ``tests/`` folder the wheel does not
ship; not part of ``pytest tests``), with compileops installed (``pip install -e ".[hf]"``)::

    pip install parameterized   # transformers' test dependency
    python tests/integrations/hf_model_tests/run.py /path/to/transformers \\
        --out hf-model-tests

``/path/to/transformers`` is a checkout of the tag of the installed transformers (e.g.
``git clone -b v5.24.0 https://github.com/huggingface/transformers``). The script runs
``pytest tests/models/<family>`` there for Qwen3-MoE, Mixtral, DeepSeek-V3 and xLSTM
(``--families`` to choose): once plain, once with ``-p compileops_hf_plugin`` (the experts
backend and ``compileops.integrations.transformers.apply()`` on every model the tests build;
see ``compileops_hf_plugin.py``). It writes both JUnit XML files and ``summary.md`` to
``--out``: pass, fail, error and skip counts per family and run, and every test whose outcome
differs between the runs, with the failure's first line. ``--only plain|compileops`` reruns
one side (the other side's XML is read from ``--out``); arguments after ``--`` go to pytest
(e.g. ``-- -k hidden_states``).

Tensor-, expert-parallel and FSDP tests are turned off (``RUN_TENSOR_PARALLEL_TESTS=0``,
``RUN_EXPERT_PARALLEL_TESTS=0``, ``RUN_FSDP_TESTS=0``): they start one process per device,
and the compileops experts backend refuses sharded (DTensor) and expert-parallel experts by
design. The compileops ops run where compileops puts them: the Triton kernels on a GPU; on a
CPU the reference backend (plain PyTorch), or with ``TRITON_INTERPRET=1`` in the environment
the Triton kernels under Triton's interpreter (slow: minutes per xLSTM test on a small CPU).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "xlstm")
RUNS = ("plain", "compileops")
PLUGIN_DIR = Path(__file__).resolve().parent
OFF = {"RUN_TENSOR_PARALLEL_TESTS": "0", "RUN_EXPERT_PARALLEL_TESTS": "0",
       "RUN_FSDP_TESTS": "0"}


def run_pytest(src: Path, families, run: str, xml: Path, extra) -> int:
    """One pytest run over the families' model tests; returns its exit code."""
    env = dict(os.environ, **OFF)
    # Only the plugin's folder: compileops comes from its installation, and the repository
    # root would put compileops' own ``tests`` package in the way of transformers'.
    paths = []
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE",
            "-W", "ignore", f"--junitxml={xml}"]
    if run == "compileops":
        paths.append(str(PLUGIN_DIR))
        args += ["-p", "compileops_hf_plugin"]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    args += [f"tests/models/{family}" for family in families] + list(extra)
    print("+", " ".join(args), flush=True)
    return subprocess.call(args, cwd=src, env=env)


# A test with subtests has one entry per failed subtest besides its own: the worst counts.
_RANK = {"skipped": 0, "passed": 1, "failed": 2, "error": 3}


def outcomes(xml: Path) -> dict:
    """``{test id: (outcome, first line of the message)}`` from a JUnit XML file; outcome is
    passed, failed, error or skipped (pytest writes xfail as skipped)."""
    result = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                text = node.get("message") or node.text or ""
                message = text.strip().splitlines()[0] if text.strip() else ""
                break
        if test not in result or _RANK[outcome] > _RANK[result[test][0]]:
            result[test] = (outcome, message)
    return result


def family_of(test: str) -> str:
    return next((f for f in FAMILIES if f".{f}." in f".{test}"), "other")


def summary(results: dict) -> str:
    lines = ["| family | run | passed | failed | errors | skipped |",
             "|---|---|---|---|---|---|"]
    for family in sorted({family_of(t) for r in results.values() for t in r}):
        for run, result in results.items():
            counts = Counter(o for t, (o, _) in result.items() if family_of(t) == family)
            lines.append(f"| {family} | {run} | {counts['passed']} | {counts['failed']} | "
                         f"{counts['error']} | {counts['skipped']} |")
    if len(results) == 2:
        plain, ours = results.values()
        differ = sorted(t for t in set(plain) | set(ours)
                        if plain.get(t, ("absent", ""))[0] != ours.get(t, ("absent", ""))[0])
        lines += ["", f"Tests whose outcome differs: {len(differ)}", ""]
        for test in differ:
            (a, _), (b, why) = plain.get(test, ("absent", "")), ours.get(test, ("absent", ""))
            reason = f": {why}" if why else ""
            lines.append(f"* `{test}`: {a} plain, {b} with compileops{reason}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("transformers_src", type=Path, help="a transformers source checkout")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--out", type=Path, default=Path("hf-model-tests"))
    parser.add_argument("--only", choices=RUNS)
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # for pytest
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    src = args.transformers_src.resolve()
    if not (src / "tests" / "test_modeling_common.py").is_file():
        parser.error(f"{src} is not a transformers source checkout "
                     "(no tests/test_modeling_common.py)")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for run in RUNS:
        xml = (args.out / f"{run}.xml").resolve()
        if args.only in (None, run):
            run_pytest(src, args.families, run, xml, extra)
        if xml.is_file():
            results[run] = outcomes(xml)
    text = summary(results)
    (args.out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
