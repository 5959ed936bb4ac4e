"""Every dotted ``compileops.*`` name the project shows its users resolves: in README.md,
CHANGELOG.md, docs/*.md, the examples, and every docstring of the package. A name resolves
the way a user reaches it: attribute access, importing a submodule first where the name is
one (``import compileops.mlstm.recurrent``). ``torch.ops.compileops.*`` op names are not
Python names and are left out."""
import ast
import importlib
import pathlib
import re

import pytest

import compileops

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Not preceded by a word character, '.', ':' or '/' (torch.ops.compileops.x, compileops::x,
# file paths), not followed by '/' or '::'.
DOTTED = re.compile(r"(?<![\w.:/])compileops(?:\.[A-Za-z_]\w*)+(?![\w/]|::)")


def _docstrings(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield doc


def _documented_names() -> dict[str, str]:
    """name -> where it was first seen."""
    texts = [(p, p.read_text()) for p in [ROOT / "README.md", ROOT / "CHANGELOG.md",
                                          *sorted((ROOT / "docs").glob("*.md")),
                                          *sorted((ROOT / "examples").glob("*.py"))]]
    for package in ("compileops", "lowerings"):
        for path in sorted((ROOT / package).rglob("*.py")):
            texts += [(path, doc) for doc in _docstrings(path)]
    names = {}
    for path, text in texts:
        for name in DOTTED.findall(text):
            names.setdefault(name.rstrip("."), str(path.relative_to(ROOT)))
    return names


NAMES = _documented_names()


def resolve(name: str):
    parts = name.split(".")
    obj = compileops
    for i, part in enumerate(parts[1:], start=1):
        if not hasattr(obj, part):
            try:
                importlib.import_module(".".join(parts[:i + 1]))
            except ModuleNotFoundError:
                pass
        obj = getattr(obj, part)  # AttributeError: the name does not resolve
    return obj


def test_the_docs_name_something():
    assert len(NAMES) > 50
    assert "compileops.grouped_linear.permute_by_expert" in NAMES


def _is_logger(name: str) -> bool:
    """compileops' loggers (``compileops.guards``, ...) are documented names too."""
    import logging

    import compileops.lowerings._compat  # noqa: F401  (creates the guards logger)

    return name in logging.Logger.manager.loggerDict


#: Documented modules that need an optional package (an extra of pyproject.toml).
OPTIONAL = {"compileops.integrations.torchtitan": "torchtitan"}


def _missing_optional(name: str):
    """The optional package ``name`` needs, when it is not installed; else None."""
    import importlib.util

    for prefix, package in OPTIONAL.items():
        if (name == prefix or name.startswith(prefix + ".")) and \
                importlib.util.find_spec(package) is None:
            return package
    return None


@pytest.mark.parametrize("name", sorted(NAMES))
def test_documented_name_resolves(name):
    missing = _missing_optional(name)
    if missing is not None:
        pytest.skip(f"{name} needs {missing} (an optional extra), not installed")
    try:
        resolve(name)
    except AttributeError as err:
        if not _is_logger(name):
            pytest.fail(f"{name} (in {NAMES[name]}) does not resolve: {err}")


def test_import_as_gives_the_subpackage_namespace():
    """``import compileops.mlstm as M`` gives the op function, which carries the mlstm
    package's names (see compileops/__init__.py)."""
    import compileops.grouped_linear.scaled as scaled
    import compileops.mlstm as M
    import compileops.mlstm.recurrent as recurrent

    assert M is compileops.mlstm and callable(M)
    assert M.recurrent is recurrent and M.mLSTMLayer is compileops.nn.mLSTMLayer
    assert compileops.grouped_linear.scaled is scaled
    assert compileops.embedding.op.embedding is compileops.embedding


def test_documented_modules_resolve_after_import_compileops_alone():
    """``import compileops`` and nothing else: the documented modules are attributes (the
    Triton kernels and the optional integrations stay imported on use)."""
    import subprocess
    import sys

    code = ("import compileops; "
            "compileops.grouped_linear.scaled.row_scaled_grouped_linear; "
            "compileops.divergence.OpFingerprints; compileops.divergence.first_divergence; "
            "compileops.mlstm.recurrent; compileops.grouped_linear.permute_by_expert")
    subprocess.run([sys.executable, "-c", code], check=True)
