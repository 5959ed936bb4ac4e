"""The grouped linear argument checks (``checks.py``) on their own: both backends run them
before any math, so the kernel-vs-reference tests cannot catch a bug in them."""
import pytest
import torch

from compileops.grouped_linear import checks, set_strict_offset_checks, strict_offset_checks
from tests.grouped_linear._helpers import make_grouped


def offsets(*values):
    return torch.tensor(values, dtype=torch.int32)


# ------------------------------------------------------------------ offset values


@pytest.mark.parametrize("values,m", [((), 0), ((0, 0, 0), 0), ((3, 3, 9), 9), ((2, 5), 12)],
                         ids=["no-groups", "all-empty", "empty-middle-group", "tail-rows"])
def test_valid_offsets_pass(values, m):
    checks.check_offset_values(offsets(*values), m)


@pytest.mark.parametrize("values,m,match", [
    ((-1, 4), 8, ">= 0"),
    ((5, 3, 9), 9, "non-decreasing"),
    ((5, 6, 10), 9, "exceeds the number of rows M = 9"),
    ((0, 0, 1), 0, "exceeds"),
], ids=["negative", "decreasing", "past-M", "rows-of-an-empty-batch"])
def test_bad_offsets_raise_value_error(values, m, match):
    with pytest.raises(ValueError, match=match):
        checks.check_offset_values(offsets(*values), m)


def test_offset_values_are_checked_eagerly_on_cpu_only_by_default(monkeypatch):
    with pytest.raises(ValueError, match="non-decreasing"):
        checks.check_offsets_eagerly(offsets(5, 3), 9)  # CPU: always
    seen = []
    monkeypatch.setattr(checks, "check_offset_values", lambda o, m: seen.append((o.device, m)))
    on_device = torch.empty(3, dtype=torch.int32, device="meta")  # stands for a CUDA tensor
    checks.check_offsets_eagerly(on_device, 9)
    assert seen == [], "a device tensor is only read in strict mode (a host sync)"
    with strict_offset_checks():
        checks.check_offsets_eagerly(on_device, 9)
    assert seen == [(on_device.device, 9)]
    checks.check_offsets_eagerly(on_device, 9)  # the context ended: off again
    set_strict_offset_checks(True)
    try:
        checks.check_offsets_eagerly(on_device, 7)
    finally:
        set_strict_offset_checks(False)
    assert seen == [(on_device.device, 9), (on_device.device, 7)]


def test_offset_values_are_never_read_while_compiling(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    checks.check_offsets_eagerly(offsets(5, 3), 9)  # would raise eagerly
    with strict_offset_checks():
        checks.check_offsets_eagerly(offsets(5, 3), 9)


# ------------------------------------------------------------------ shapes, dtypes, devices


def test_valid_arguments_pass():
    for dtype in checks.DTYPES:
        x, w, offs, b = make_grouped([3, 0, 4], k=8, n=6, dtype=dtype, extra_rows=1)
        checks.check_forward_args(x, w, offs, b)
        checks.check_forward_args(x, w, offs, None, swiglu=True)
        checks.check_dx_args(torch.randn(8, 6).to(dtype), w, offs)
        checks.check_wgrad_args(torch.randn(8, 6).to(dtype), x, offs)


def test_checks_run_on_meta_tensors():
    """The fake functions call the same checks on tensors without data."""
    x, w, offs, b = (t.to("meta") for t in make_grouped([3, 4], k=8, n=6))
    checks.check_forward_args(x, w, offs, b, swiglu=True)
    with pytest.raises(ValueError, match="mismatched K"):
        checks.check_forward_args(x[:, :5], w, offs, b)


BAD_FORWARD = {
    "3-D x": (lambda x, w, o, b: (x[None], w, o, b), RuntimeError, "x must be 2-D"),
    "2-D weight": (lambda x, w, o, b: (x, w[0], o, b), RuntimeError, "weight must be 3-D"),
    "2-D offsets": (lambda x, w, o, b: (x, w, o[None], b), RuntimeError, "offsets must be 1-D"),
    "int x": (lambda x, w, o, b: (x.int(), w.int(), o, b.int()), TypeError,
              "bf16, fp16, fp32 or fp64"),
    "weight dtype": (lambda x, w, o, b: (x, w.half(), o, b), TypeError, "weight dtype"),
    "int64 offsets": (lambda x, w, o, b: (x, w, o.long(), b), TypeError, "int32"),
    "offsets length": (lambda x, w, o, b: (x, w, o[:2], b), ValueError, "one entry per group"),
    "mismatched K": (lambda x, w, o, b: (x[:, :7], w, o, b), ValueError, "mismatched K"),
    "bias shape": (lambda x, w, o, b: (x, w, o, b[:, :3]), ValueError, "bias must be"),
    "1-D bias": (lambda x, w, o, b: (x, w, o, b[0]), ValueError, "bias must be"),
    "bias dtype": (lambda x, w, o, b: (x, w, o, b.half()), TypeError, "bias dtype"),
    "weight device": (lambda x, w, o, b: (x, w.to("meta"), o, b), RuntimeError,
                      "weight is on meta but x is on cpu"),
    "bias device": (lambda x, w, o, b: (x, w, o, b.to("meta")), RuntimeError,
                    "bias is on meta but x is on cpu"),
}


@pytest.mark.parametrize("case", list(BAD_FORWARD))
def test_bad_forward_arguments_raise(case):
    make_args, exc, match = BAD_FORWARD[case]
    x, w, offs, b = make_grouped([3, 4, 5], k=8, n=6)
    with pytest.raises(exc, match=match):
        checks.check_forward_args(*make_args(x, w, offs, b))


def test_swiglu_needs_an_even_n():
    x, w, offs, b = make_grouped([3, 4], k=8, n=7)
    checks.check_forward_args(x, w, offs, b)
    with pytest.raises(ValueError, match="even N"):
        checks.check_forward_args(x, w, offs, b, swiglu=True)


def test_bad_dx_arguments_raise():
    x, w, offs, _ = make_grouped([3, 4], k=8, n=6)
    with pytest.raises(ValueError, match="does not match weight"):
        checks.check_dx_args(torch.randn(7, 5), w, offs)
    with pytest.raises(RuntimeError, match="grad must be 2-D"):
        checks.check_dx_args(torch.randn(7), w, offs)
    with pytest.raises(TypeError, match="weight dtype"):
        checks.check_dx_args(torch.randn(7, 6).half(), w, offs)
    with pytest.raises(ValueError, match="one entry per group"):
        checks.check_dx_args(torch.randn(7, 6), w, offs[:1])


def test_bad_wgrad_arguments_raise():
    x, _, offs, _ = make_grouped([3, 4], k=8, n=6)
    grad = torch.randn(7, 6)
    with pytest.raises(ValueError, match="grad has 6 rows but x has 7"):
        checks.check_wgrad_args(grad[:6], x, offs)
    with pytest.raises(TypeError, match="int32"):
        checks.check_wgrad_args(grad, x, offs.long())
    with pytest.raises(RuntimeError, match="x must be 2-D"):
        checks.check_wgrad_args(grad, x[None], offs)
    with pytest.raises(RuntimeError, match="offsets is on meta but grad is on cpu"):
        checks.check_wgrad_args(grad, x, offs.to("meta"))


def test_kernel_dtype_refuses_fp64_naming_the_reference_backend():
    checks.check_kernel_dtype("grouped_linear", torch.zeros(2, dtype=torch.float32))
    with pytest.raises(TypeError, match="fp64 runs on the reference backend"):
        checks.check_kernel_dtype("grouped_linear", torch.zeros(2, dtype=torch.float64))
