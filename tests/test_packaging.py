"""The distribution as a user installs it: the package list in pyproject.toml matches the
tree, and a wheel built from the tree installs ``compileops`` alone (the lowerings inside
it, as ``compileops.lowerings``, with their templates) and works from outside the source
tree: every module imports from the installed copy and the Triton templates are found."""
import os
import pathlib
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _tree_packages() -> set[str]:
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "compileops").rglob("__init__.py")}
    found |= {"compileops.lowerings." + ".".join(p.parent.relative_to(ROOT / "lowerings").parts)
              for p in (ROOT / "lowerings").rglob("__init__.py")}
    return {name.rstrip(".") for name in found}


def _tree_modules() -> set[str]:
    """Every module of the tree under the name it has once installed."""
    def dotted(path: pathlib.Path, root: pathlib.Path, prefix: str) -> str:
        parts = path.relative_to(root).with_suffix("").parts
        return ".".join((prefix, *(parts[:-1] if parts[-1] == "__init__" else parts)))

    names = {dotted(p, ROOT / "compileops", "compileops")
             for p in (ROOT / "compileops").rglob("*.py")}
    names |= {dotted(p, ROOT / "lowerings", "compileops.lowerings")
              for p in (ROOT / "lowerings").rglob("*.py")}
    return names - {"compileops"}


def test_pyproject_lists_every_package_of_the_tree():
    setuptools = _pyproject()["tool"]["setuptools"]
    assert set(setuptools["packages"]) == _tree_packages()
    assert setuptools["package-dir"] == {"compileops.lowerings": "lowerings"}


def test_version_is_one_place():
    import compileops

    assert _pyproject()["project"]["dynamic"] == ["version"]
    assert compileops.__version__ == "0.1.0"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                           str(out), str(ROOT)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"pip wheel failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    (path,) = out.glob("compileops-*.whl")
    return path


def test_wheel_holds_one_top_level_package_and_the_templates(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"compileops"}
    assert "compileops/lowerings/_compat.py" in names
    assert "compileops/lowerings/templates/grouped_linear.py.jinja" in names
    assert "compileops/lowerings/templates/mlstm.py.jinja" in names
    metadata = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: BSD-3-Clause" in metadata
    assert "Requires-Dist: numpy" in metadata


def test_installed_wheel_works_outside_the_source_tree(wheel, tmp_path):
    """The wheel installed on its own (torch and friends from this environment), run from a
    directory that is not the checkout: every module of the package imports from the
    installed copy (an integration may fail with an ImportError that names the third-party
    library it needs, when that library is missing), and the grouped-linear template (a
    packaged .jinja file) generates Triton code. (``python -m compileops``, each family's
    compiled demo, is the README's first command; running it again here cost a minute and a
    half of the suite.)"""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = str(site)
    script = (
        "import importlib, importlib.util, pkgutil\n"
        "import compileops, torch\n"
        "from compileops.testing import inductor_kernels\n"
        f"site = {str(site)!r}\n"
        "assert compileops.__file__.startswith(site), compileops.__file__\n"
        "assert importlib.util.find_spec('lowerings') is None\n"
        "imported, optional = [], []\n"
        "for info in pkgutil.walk_packages(compileops.__path__, 'compileops.'):\n"
        "    try:\n"
        "        module = importlib.import_module(info.name)\n"
        "    except ImportError as err:\n"
        "        cause = err.__cause__ or err.__context__\n"
        "        missing = err.name or getattr(cause, 'name', None) or 'compileops'\n"
        "        if missing.startswith('compileops') or '.integrations.' not in info.name:\n"
        "            raise\n"
        "        optional.append(info.name)\n"
        "        continue\n"
        "    assert module.__file__.startswith(site), (info.name, module.__file__)\n"
        "    imported.append(info.name)\n"
        "print('modules:', ' '.join(imported + optional))\n"
        "print('optional library missing:', ' '.join(optional))\n"
        "x, w = torch.randn(8, 16), torch.randn(2, 24, 16)\n"
        "offs = torch.tensor([3, 8], dtype=torch.int32)\n"
        "print(inductor_kernels(compileops.grouped_linear, x, w, offs, triton=True))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = set(proc.stdout.split("modules:")[1].splitlines()[0].split())
    assert found == _tree_modules(), proc.stdout[-2000:]
    optional = proc.stdout.split("optional library missing:")[1].splitlines()[0].split()
    assert all(".integrations." in name for name in optional), optional
    assert "triton_tem_" in proc.stdout, proc.stdout
