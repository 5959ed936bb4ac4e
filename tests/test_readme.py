"""The README's code blocks run as written: the Hugging Face ones (skipped without
transformers) and the export one; and .ci/run runs the README's commands."""
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _section_code(title: str) -> str:
    text = README.read_text()
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, f"no python block under '## {title}'"
    return "\n".join(blocks)


def test_readme_hugging_face_block_runs():
    pytest.importorskip("transformers", minversion="5.7")
    exec(compile(_section_code("Use it with Hugging Face"), "README.md", "exec"), {})


def test_readme_hugging_face_xlstm_block_runs():
    pytest.importorskip("transformers", minversion="5.7")
    namespace = {}
    exec(compile(_section_code("Use it with Hugging Face xLSTM"), "README.md", "exec"),
         namespace)
    out, prompt = namespace["out"], 8
    assert out.shape[0] == 2 and out.shape[1] > prompt  # generated tokens past the prompt
    assert namespace["loss"].isfinite()


def test_readme_export_block_runs():
    exec(compile(_section_code("Export"), "README.md", "exec"), {})


def test_ci_runs_the_readme_commands():
    """.ci/run reads its commands out of the README: the demo, the tests, and the tests of
    another supported torch, each a one-line install-then-run a user can paste."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "readme_command", README.parent / ".ci" / "readme_command.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    demo, tests, other_torch = module.commands()
    assert demo.endswith("python -m compileops") and "pip install -e ." in demo
    assert tests.endswith("python -m pytest -q -n 2 tests") and '".[test,hf,titan]"' in tests
    assert other_torch.startswith("python -m pip install torch==2.11.0 ")
    assert other_torch.endswith("-m compat tests")
    ci = (README.parent / ".ci" / "run").read_text()
    assert '"$(readme 1)" "$(readme 2)"' in ci and '"$(readme 3)"' in ci
    assert "pip install" not in ci  # everything is installed by the README's own commands
