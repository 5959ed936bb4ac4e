"""The README's code blocks run as written: the Hugging Face one (skipped without
transformers) and the export one."""
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


def test_readme_export_block_runs():
    exec(compile(_section_code("Export"), "README.md", "exec"), {})
