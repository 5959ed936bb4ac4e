"""Helpers shared by the grouped-linear tests."""
import os
import sys


def import_sweep():
    """``benchmarks/sweep_grouped_linear.py`` (the configs the GPU sweep times), imported from
    the repository root whatever directory pytest runs from."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, root)
    try:
        from benchmarks import sweep_grouped_linear
    finally:
        sys.path.remove(root)
    return sweep_grouped_linear
