"""Graph snapshots on every supported torch: one expected text per version where they differ.

A snapshot test writes its expected text inline, as printed by the base torch
(:data:`BASE`, the version the inline texts were written on):
``self.assertSnapshot(actual, \"\"\"...\"\"\")``. On the base torch this is expecttest's
``assertExpectedInline``. Another supported torch compares against its own file,
``tests/snapshots/torch-<major>.<minor>/<test id>.<n>.txt`` (``n`` counts the snapshots of
one test), where one exists, and against the inline text otherwise: a version needs a
file only where its graph differs.

Regenerate on any torch with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/<family>/
test_snapshots.py``: on the base torch the inline texts are rewritten (expecttest); on
another, its files are written where the text differs from the inline one, and removed
where it no longer does.
"""
from __future__ import annotations

import os
import pathlib

import expecttest
import torch

BASE = (2, 13)
SNAPSHOTS = pathlib.Path(__file__).resolve().parent / "snapshots"


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def version_file(test_id: str, index: int, version: tuple[int, int]) -> pathlib.Path:
    """Where ``version``'s text of the ``index``-th snapshot of ``test_id`` lives."""
    name = test_id.removeprefix("tests.")
    return SNAPSHOTS / f"torch-{version[0]}.{version[1]}" / f"{name}.{index}.txt"


class SnapshotTestCase(expecttest.TestCase):
    maxDiff = None
    def setUp(self):
        super().setUp()
        self._snapshots_taken = 0

    def assertSnapshot(self, actual: str, expect: str) -> None:
        """``actual`` equals this torch's expected text (see the module docstring)."""
        index = self._snapshots_taken
        self._snapshots_taken += 1
        version = torch_version()
        if version == BASE:
            self.assertExpectedInline(actual, expect, skip=1)
            return
        path = version_file(self.id(), index, version)
        if os.getenv("EXPECTTEST_ACCEPT"):
            if actual == expect:
                path.unlink(missing_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(actual)
            return
        expected = path.read_text() if path.exists() else expect
        self.assertMultiLineEqual(expected, actual,
                                  f"torch {torch.__version__}: the snapshot in "
                                  f"{path if path.exists() else 'the test (inline)'} differs; "
                                  "if the change is intended, regenerate with "
                                  "EXPECTTEST_ACCEPT=1")
