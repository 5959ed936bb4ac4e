"""The interpreter's bounds checker (tests/bounds.py) fails a kernel that reads or writes
outside its tensors' storages, and leaves in-bounds and masked-off accesses alone."""
import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tests import bounds  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="checks Triton's interpreter")


@pytest.fixture(scope="module")
def kernels():
    bounds.install()

    @triton.jit
    def copy_shifted(x_ptr, out_ptr, n, load_shift, store_shift, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        values = tl.load(x_ptr + i + load_shift, mask=i < n, other=0.0)
        tl.store(out_ptr + i + store_shift, values, mask=i < n)

    return copy_shifted


def test_in_bounds_and_masked_lanes_pass(kernels):
    x, out = torch.randn(8), torch.empty(8)
    kernels[(1,)](x, out, 8, 0, 0, BLOCK=16)  # lanes 8..15 are masked off
    assert torch.equal(out, x)


def test_a_load_past_the_end_raises(kernels):
    x, out = torch.randn(8), torch.zeros(8)
    # The interpreter wraps the kernel's exception in its own error, keeping the message.
    with pytest.raises(Exception, match="OutOfBounds.*copy_shifted: load of 1 element"):
        kernels[(1,)](x, out, 8, 1, 0, BLOCK=16)
    with pytest.raises(Exception, match="OutOfBounds.*copy_shifted: load of 8 element"):
        kernels[(1,)](x, out, 8, 1 << 20, 0, BLOCK=16)


def test_a_store_before_the_start_raises(kernels):
    x, out = torch.randn(8), torch.zeros(8)
    with pytest.raises(Exception, match="OutOfBounds.*copy_shifted: store"):
        kernels[(1,)](x, out, 8, 0, -1, BLOCK=16)


def test_a_view_may_read_its_whole_storage(kernels):
    base = torch.randn(16)
    out = torch.empty(8)
    kernels[(1,)](base[:8], out, 8, 8, 0, BLOCK=16)  # reads base[8:16], inside the storage
    assert torch.equal(out, base[8:])
