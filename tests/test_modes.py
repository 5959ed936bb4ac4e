"""compileops.modes: process-wide defaults plus per-context overrides that never leak."""
import ast
import pathlib
import threading

import compileops
from compileops import modes


def test_default_setter_and_context_override_nest_and_restore():
    mode = modes.Mode("probe")
    assert not mode.enabled()
    with mode.override():
        assert mode.enabled()
        with mode.override(False):
            assert not mode.enabled()
        assert mode.enabled()
    assert not mode.enabled()
    mode.set_default(True)
    try:
        assert mode.enabled()
        with mode.override(False):
            assert not mode.enabled()
        assert mode.enabled()
    finally:
        mode.set_default(False)
    assert not mode.enabled()


def test_override_does_not_leak_into_another_thread():
    seen = []
    with compileops.batch_invariant():
        assert modes.is_batch_invariant()
        worker = threading.Thread(target=lambda: seen.append(modes.is_batch_invariant()))
        worker.start()
        worker.join()
    assert seen == [False]
    assert not modes.is_batch_invariant()


def test_override_is_restored_after_an_exception():
    try:
        with compileops.strict_index_checks():
            assert modes.STRICT_INDEX_CHECKS.enabled()
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert not modes.STRICT_INDEX_CHECKS.enabled()


def test_public_setters_drive_the_modes():
    for setter, mode in [
        (compileops.set_strict_index_checks, modes.STRICT_INDEX_CHECKS),
        (compileops.set_strict_offset_checks, modes.STRICT_OFFSET_CHECKS),
        (compileops.set_batch_invariant, modes.BATCH_INVARIANT),
    ]:
        setter(True)
        try:
            assert mode.enabled()
        finally:
            setter(False)
        assert not mode.enabled()


def test_self_check_imports_point_down():
    """Family demos import only the leaf Demo dataclass, never the top-level report."""
    root = pathlib.Path(compileops.__file__).parent
    for demo in sorted(root.glob("*/selfcheck.py")):
        imported = {
            node.module
            for node in ast.walk(ast.parse(demo.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module
        }
        assert "compileops._selfcheck" not in imported, demo
        assert "compileops" not in imported, demo
    report = (root / "_selfcheck.py").read_text()
    assert "import compileops\n" not in report


def test_version_has_one_source():
    from compileops._version import __version__

    assert compileops.__version__ == __version__
