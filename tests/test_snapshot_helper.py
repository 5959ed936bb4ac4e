"""tests/snapshot.py: the per-version snapshot files, as every snapshot test uses them."""
import pytest

from tests import snapshot


class _Case(snapshot.SnapshotTestCase):
    def runTest(self):  # noqa: N802 (unittest's name)
        pass

    def id(self):
        return "tests.family.test_snapshots.Case.test_graph"


@pytest.fixture
def other_version(monkeypatch, tmp_path):
    monkeypatch.setattr(snapshot, "SNAPSHOTS", tmp_path)
    monkeypatch.setattr(snapshot, "torch_version", lambda: (9, 1))
    monkeypatch.delenv("EXPECTTEST_ACCEPT", raising=False)
    case = _Case()
    case.setUp()
    return case, tmp_path / "torch-9.1" / "family.test_snapshots.Case.test_graph.0.txt"


def test_another_version_without_a_file_compares_with_the_inline_text(other_version):
    case, _ = other_version
    case.assertSnapshot("graph A", "graph A")
    with pytest.raises(AssertionError, match="differs"):
        case.assertSnapshot("graph B", "graph A")


def test_another_versions_file_wins_over_the_inline_text(other_version):
    case, path = other_version
    path.parent.mkdir(parents=True)
    path.write_text("graph B")
    case.assertSnapshot("graph B", "graph A")
    case.setUp()
    with pytest.raises(AssertionError, match=str(path.name)):
        case.assertSnapshot("graph A", "graph A")


def test_accept_writes_a_file_only_where_the_text_differs(other_version, monkeypatch):
    case, path = other_version
    monkeypatch.setenv("EXPECTTEST_ACCEPT", "1")
    case.assertSnapshot("graph B", "graph A")
    assert path.read_text() == "graph B"
    case.setUp()
    case.assertSnapshot("graph A", "graph A")  # back to the inline text: the file goes
    assert not path.exists()


def test_snapshots_of_one_test_are_numbered_in_order(other_version):
    case, path = other_version
    second = path.with_name(path.name.replace(".0.txt", ".1.txt"))
    second.parent.mkdir(parents=True)
    second.write_text("backward B")
    case.assertSnapshot("forward", "forward")
    case.assertSnapshot("backward B", "backward A")


def test_every_version_file_belongs_to_a_supported_torch_and_a_snapshot_test():
    import pathlib

    root = pathlib.Path(snapshot.__file__).parent
    for path in snapshot.SNAPSHOTS.rglob("*.txt"):
        version = path.parent.name
        assert version.startswith("torch-2.") and 11 <= int(version.split(".")[1]) <= 15, path
        # <package path>.<test module>.<class>.<test>.<n>.txt, the test module a test_*.py
        parts = path.name.split(".")
        at = next(i for i, part in enumerate(parts) if part.startswith("test_"))
        module = root.joinpath(*parts[:at], parts[at] + ".py")
        assert module.exists(), path
        assert f"def {parts[at + 2]}(" in module.read_text(), path
