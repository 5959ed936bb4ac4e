"""benchmarks/bench_mlstm.py's CSV rows name what was run: raw h and a non-default head shape
(rows of xLSTM-7B's head were otherwise indistinguishable from the default head's)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench_mlstm import impl_suffix  # noqa: E402


def test_csv_impl_names_raw_h_and_the_head_shape():
    default = dict(raw=False, heads=16, dqk=128, dv=256)
    assert impl_suffix(default) == ""
    assert impl_suffix(dict(default, raw=True)) == " (raw h)"
    assert impl_suffix(dict(default, heads=8, dqk=256, dv=512)) == " (NH 8, DQK 256, DV 512)"
    assert impl_suffix(dict(raw=True, heads=16, dqk=128, dv=512)) == \
        " (raw h) (NH 16, DQK 128, DV 512)"
