"""Preconditions of the mLSTM ops, shared by the fake functions and the eager paths.

Every check is a ``torch._check`` (through :func:`compileops._library.require`, which returns
at once on a plain ``True``) with a message naming the argument, so it raises the same clear
error eagerly and while ``torch.compile`` traces.
"""
from __future__ import annotations

from typing import Optional

import torch

from compileops._library import check_same_device, custom_op, require, require_tensors

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
#: Head dims the Triton kernels hold in registers (a program owns whole rows).
MAX_KERNEL_HEAD_DIM = 256
KERNELS = ("auto", "parallel", "chunkwise")

#: The largest ``chunk_size``. Within a chunk the work is the parallel form's, quadratic in
#: the chunk, and the Triton kernels hold a chunk's gates in one block: a larger chunk runs
#: slower than ``kernel="parallel"`` and, from 2**20 rows, past Triton's block limit.
MAX_CHUNK = 4096


def check_chunk(chunk: int) -> None:
    if chunk < 16 or chunk > MAX_CHUNK or chunk & (chunk - 1):
        raise ValueError(f"chunk_size must be a power of two from 16 to {MAX_CHUNK}, got "
                         f"{chunk} (for one chunk over a long row, use kernel=\"parallel\")")


def check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    fgate: torch.Tensor, norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor],
    norm_eps: float, eps: float, *, one_token: bool = False,
) -> None:
    """Shapes ``q, k [B, NH, S, DQK]``, ``v [B, NH, S, DV]``, ``igate, fgate [B, NH, S]``,
    ``norm_weight, norm_bias [NH * DV]``; one floating dtype for q, k, v; one device.
    ``one_token`` (the decode step): no S axis, ``q, k [B, NH, DQK]`` and so on.

    Where a wrong shape fits a likely layout mistake (q, k, v as ``[B, S, NH, D]``, the
    attention layout; a sequence of one token passed to the step), the message names it
    (:func:`_layout_hint`)."""
    require_tensors((("q", q), ("k", k), ("v", v), ("igate", igate), ("fgate", fgate)))
    lead = "B, NH" if one_token else "B, NH, S"  # the axes before a head's features
    rank = 3 if one_token else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        require(t.dim() == rank, lambda: f"{name} must be {rank}-D [{lead}, D]"
                f"{' (one token)' if one_token else ''}, got shape {tuple(t.shape)}"
                + _layout_hint(name, q, t, one_token))
        require(t.dtype in KERNEL_DTYPES, lambda: f"{name} must be bf16, fp16, fp32 or "
                f"fp64, got {t.dtype}")
    require(k.shape == q.shape, lambda: f"k must have q's shape {tuple(q.shape)} "
            f"[{lead}, DQK], got {tuple(k.shape)}" + _layout_hint("k", q, k, one_token))
    require(v.shape[:rank - 1] == q.shape[:rank - 1], lambda: f"v must be [{lead}, DV] with "
            f"q's {lead} {tuple(q.shape[:rank - 1])}, got {tuple(v.shape)}"
            + _layout_hint("v", q, v, one_token))
    require(q.shape[rank - 1] > 0 and v.shape[rank - 1] > 0, lambda: "the head dims DQK "
            f"and DV must be at least 1, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    require(k.dtype == q.dtype and v.dtype == q.dtype, lambda: "q, k and v must share "
            f"one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    for name, g in (("igate", igate), ("fgate", fgate)):
        require(g.shape == q.shape[:rank - 1], lambda: f"{name} must be [{lead}] = "
                f"{tuple(q.shape[:rank - 1])}, got {tuple(g.shape)}"
                + _layout_hint(name, q, g, one_token))
        require(g.is_floating_point(), lambda: f"{name} must be floating point, got "
                f"{g.dtype}")
    channels = q.shape[1] * v.shape[rank - 1]
    for name, p in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if p is None:
            continue
        require(p.dim() == 1 and p.shape[0] == channels, lambda: f"{name} must be "
                f"[NH * DV] = [{channels}], got {tuple(p.shape)}"
                + _norm_layout_hint(q, v, p, one_token))
        require(p.is_floating_point(), lambda: f"{name} must be floating point, got "
                f"{p.dtype}")
    named = [("q", q), ("k", k), ("v", v), ("igate", igate), ("fgate", fgate)]
    named += [(n, p) for n, p in (("norm_weight", norm_weight), ("norm_bias", norm_bias))
              if p is not None]
    check_same_device(named)
    require(eps >= 0, lambda: f"eps must be >= 0, got {eps}")
    require(norm_eps > 0, lambda: f"norm_eps must be > 0, got {norm_eps}")


#: The sequence forms' layout, as the hints below state it.
SEQUENCE_LAYOUT = "q, k [B, NH, S, DQK], v [B, NH, S, DV] and the gates [B, NH, S]"


def _axes_1_2_swapped(reference: tuple, got: tuple) -> bool:
    """``got`` starts with ``reference``'s first three sizes, the second and third exchanged
    (and they differ, or nothing would show)."""
    return (len(reference) >= 3 and len(got) >= 3 and reference[1] != reference[2]
            and tuple(got[:3]) == (reference[0], reference[2], reference[1]))


def _layout_hint(name: str, q: torch.Tensor, t: torch.Tensor, one_token: bool) -> str:
    """The likely layout mistake behind a wrong shape of ``t`` (argument ``name``) next to
    ``q``, as text to append to the message, or ``""`` when the shapes fit none.

    Sequence forms: ``t``'s axes 1 and 2 are ``q``'s exchanged, the signature of q, k and v
    passed as ``[B, S, NH, D]`` (the attention layout) with the gates ``[B, NH, S]``, or the
    other way round. The step: a sequence of one token (an S axis of size 1) where it takes
    one token without an S axis."""
    shape, qs = tuple(t.shape), tuple(q.shape)
    if one_token:
        if t.dim() == 4 and name in ("q", "k", "v"):
            if shape[2] == 1:
                return (f": a sequence of one token [B, NH, 1, D]? mlstm_step takes the token "
                        f"without the S axis: pass {name}.squeeze(2)")
            if shape[1] == 1:
                return (f": a sequence of one token [B, 1, NH, D]? mlstm_step takes [B, NH, D] "
                        f"without the S axis: pass {name}.squeeze(1)")
        if t.dim() == 3 and name in ("igate", "fgate") and q.dim() == 3:
            if shape == (qs[0], qs[1], 1):
                return (f": mlstm_step takes the gates of one token without the S axis: pass "
                        f"{name}.squeeze(-1)")
            if shape == (qs[0], 1, qs[1]):
                return (f": mlstm_step takes the gates of one token [B, NH] without the S "
                        f"axis: pass {name}.squeeze(1)")
        return ""
    if q.dim() != 4 or not _axes_1_2_swapped(qs, shape):
        return ""
    if name in ("igate", "fgate"):
        return (f": axes 1 and 2 are swapped between q and {name}. If q, k and v are [B, S, "
                f"NH, D] (S = {qs[1]}, NH = {qs[2]}), pass q.transpose(1, 2), k.transpose(1, "
                f"2) and v.transpose(1, 2); if {name} is [B, S, NH], pass {name}.transpose(1, "
                f"2). The mLSTM takes {SEQUENCE_LAYOUT}")
    return (f": axes 1 and 2 are swapped between q and {name}, so one of them is [B, S, NH, "
            f"D] (the attention layout); pass that one as .transpose(1, 2). The mLSTM takes "
            f"{SEQUENCE_LAYOUT}")


def _norm_layout_hint(q: torch.Tensor, v: torch.Tensor, p: torch.Tensor,
                      one_token: bool) -> str:
    """A norm parameter of ``NH * DV`` entries for NH = q's axis 2: q, k, v passed as ``[B,
    S, NH, D]`` with the gates ``[B, S, NH]`` pass every other check (the S and NH axes are
    consistently exchanged), and only the norm's length tells."""
    if one_token or q.dim() != 4 or v.dim() != 4 or q.shape[1] == q.shape[2]:
        return ""
    if p.dim() != 1 or p.shape[0] != q.shape[2] * v.shape[3]:
        return ""
    return (f": it fits NH = {q.shape[2]}, q's axis 2. Are q, k and v [B, S, NH, D] and the "
            f"gates [B, S, NH]? Then pass each .transpose(1, 2): the mLSTM takes "
            f"{SEQUENCE_LAYOUT}")


def check_gates_floating(igate: torch.Tensor, fgate: torch.Tensor) -> None:
    """Before the public function converts the gates to their accumulation dtype (which would
    hide an integer gate): plain raises, which Dynamo traces as they are."""
    if not igate.is_floating_point():
        raise TypeError(f"igate must be floating point, got {igate.dtype}")
    if not fgate.is_floating_point():
        raise TypeError(f"fgate must be floating point, got {fgate.dtype}")


def check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")


def check_kernel_head_dims(q: torch.Tensor, v: torch.Tensor) -> None:
    """The Triton kernels hold whole rows of a head in registers."""
    dqk, dv = q.shape[-1], v.shape[-1]
    require(dqk <= MAX_KERNEL_HEAD_DIM and dv <= MAX_KERNEL_HEAD_DIM, lambda: (
        f"the Triton mLSTM kernels take head dims up to {MAX_KERNEL_HEAD_DIM}, got q's DQK "
        f"{dqk} and v's DV {dv}; use compileops.use_backend('reference') for larger ones"))


def check_backward_grad(grad: torch.Tensor, expected: tuple, what: str) -> None:
    require(tuple(grad.shape) == tuple(expected), lambda: f"{what} must have shape "
            f"{tuple(expected)}, got {tuple(grad.shape)}")


def check_log_gates(q: torch.Tensor, igate: torch.Tensor, logf: torch.Tensor) -> None:
    """The op's gate inputs are in the accumulation dtype (fp32, fp64 for fp64 inputs)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    for name, g in (("igate", igate), ("logf", logf)):
        require(g.dtype == acc, lambda: f"{name} must be {acc} for {q.dtype} inputs (the "
                f"gates' accumulation dtype), got {g.dtype}; compileops.mlstm converts")


#: The message of the device-side check of ``cu_seqlens`` (no host sync there, so it cannot
#: name the entry; :func:`check_cu_seqlens_values` does, on the host).
CU_SEQLENS_INVALID = (
    "compileops.mlstm: cu_seqlens must be the cumulative document ends [0, ..., S], "
    "non-decreasing, starting at 0 and ending at S (run eagerly under "
    "compileops.strict_offset_checks() to see the bad entry)"
)


def check_cu_seqlens_layout(cu_seqlens, batch: int, device: torch.device) -> None:
    """``cu_seqlens``: a 1-D int32 or int64 tensor ``[N + 1]`` (N >= 1 documents) on the
    inputs' device, the documents packed in one row (B = 1). Static: no values read."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a tensor [N + 1] of cumulative document ends, "
                        f"got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D [N + 1] with N >= 1 documents (its first "
                         f"entry 0, its last S), got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, the inputs on {device}")
    if batch != 1:
        raise ValueError(f"with cu_seqlens the documents are packed in one row: B must be 1, "
                         f"got {batch}")


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, seq: int) -> None:
    """Raise ``ValueError`` naming the first entry that keeps ``cu_seqlens`` from rising from
    0 to ``seq`` without decreasing. Reads it on the host (a device sync on GPUs)."""
    ends = cu_seqlens.detach().to("cpu", torch.int64).tolist()
    if ends[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {ends[0]}")
    if ends[-1] != seq:
        # S is q's axis 2: q, k, v passed as [B, S, NH, D] surface here first when packed.
        raise ValueError(f"cu_seqlens must end at S = {seq} (the packed row's length: axis 2 "
                         f"of q [B, NH, S, D]), got cu_seqlens[-1] = {ends[-1]}")
    for i, (a, b) in enumerate(zip(ends, ends[1:])):
        if b < a:
            raise ValueError(f"cu_seqlens must not decrease, got cu_seqlens[{i}] = {a} and "
                             f"cu_seqlens[{i + 1}] = {b}")


def check_cu_seqlens(cu_seqlens, batch: int, seq: int, device: torch.device) -> None:
    """All of ``cu_seqlens``'s checks, the values where they cost no host sync.

    The layout always (:func:`check_cu_seqlens_layout`). The values
    (:func:`check_cu_seqlens_values`, naming the entry): on CPU tensors, and on other devices
    under :func:`compileops.strict_offset_checks` (one device sync per call), when running
    eagerly. Otherwise (CUDA without strict checks, and everything compiled) they are checked
    on the device with ``torch._assert_async``: compiled on CPU it raises a
    ``RuntimeError`` with :data:`CU_SEQLENS_INVALID`; on CUDA it is a device-side assert,
    which ends the process's CUDA context."""
    from compileops.modes import host_value_checks

    check_cu_seqlens_layout(cu_seqlens, batch, device)
    if host_value_checks(cu_seqlens):
        check_cu_seqlens_values(cu_seqlens, seq)
        return
    valid = ((cu_seqlens[0] == 0) & (cu_seqlens[-1] == seq)
             & (cu_seqlens[1:] >= cu_seqlens[:-1]).all())
    torch._assert_async(valid, CU_SEQLENS_INVALID)


def check_initial_state(initial_state) -> None:
    """``initial_state``: None, or ``(C, n, m)``, a tuple (or list) of three tensors, as
    ``return_last_state=True`` returns it. Their shapes, dtypes and devices are the op's
    checks."""
    if initial_state is None:
        return
    expected = ("initial_state must be a tuple (C [B, NH, DQK, DV], n [B, NH, DQK], m [B, NH]) "
                "of three tensors, as return_last_state=True returns it")
    if not isinstance(initial_state, (tuple, list)):
        raise TypeError(f"{expected}; got {type(initial_state).__name__}")
    if len(initial_state) != 3:
        raise ValueError(f"{expected}; got {len(initial_state)} items")
    for name, t in zip(("C", "n", "m"), initial_state):
        if t is None:
            raise ValueError(f"{expected}; got a partial state ({name} is None)")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{expected}; got {type(t).__name__} for {name}")


@custom_op("mlstm_check_inputs")
def check_inputs_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
                    fgate: torch.Tensor, norm_weight: Optional[torch.Tensor],
                    norm_bias: Optional[torch.Tensor], norm_eps: float, eps: float) -> None:
    """:func:`check_inputs` as an op of its own, for code that Dynamo traces before any
    mLSTM op sees the inputs (the packed layout indexes them by their shapes). Dynamo cannot
    build the checks' messages in traced Python (a ``torch._check`` message reading the
    shapes breaks a fullgraph trace); an op's fake function runs them on the fake tensors
    instead, so a compiled call raises the eager call's message."""
    check_inputs(q, k, v, igate, fgate, norm_weight, norm_bias, norm_eps, eps)


@check_inputs_op.register_fake
def _check_inputs_fake(q, k, v, igate, fgate, norm_weight, norm_bias, norm_eps, eps) -> None:
    check_inputs(q, k, v, igate, fgate, norm_weight, norm_bias, norm_eps, eps)
