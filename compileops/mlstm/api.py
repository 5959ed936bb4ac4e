"""The public mLSTM functions: :func:`mlstm` and :func:`mlstm_with_stats`."""
from __future__ import annotations

import numbers
from typing import Optional

import torch

from compileops._library import require_tensors
from compileops.mlstm.checks import (
    check_chunk,
    MAX_KERNEL_HEAD_DIM,
    check_cu_seqlens,
    check_gates_floating,
    check_initial_state,
    check_inputs,
    check_inputs_op,
    check_kernel,
)
from compileops.mlstm import documents
from compileops.mlstm.chunkwise import mlstm_chunkwise_op
from compileops.mlstm.op import mlstm_parallel_op
from compileops.mlstm.gates import log_forget_op
from compileops.mlstm.reference import floor_input_gate, gate_dtype, multihead_layernorm


def _needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in tensors)


#: ``kernel="auto"`` runs the parallel form up to these sequence lengths (with a gradient to
#: compute / without) and the chunkwise form above them, and whenever states go in or out. With
#: a gradient, the limit is chosen by accuracy first. bf16 on an H200 (2026-12-02; B 2, NH 4,
#: DQK 128, DV 256, four gate distributions of tests/mlstm/test_precision.py, against fp64;
#: benchmarks/RESULTS.md): the chunkwise form's forget-gate gradient is within 7.4e-3 at S =
#: 1024 and 8192 (its sums paired, :func:`compileops.mlstm.set_fast_gate_gradients`), the
#: parallel form's 1.1-1.5e-2 at 1024 and up to 9.5e-2 at 8192; every other gradient is
#: within 8.1e-3 in both. Speed, compiled fw+bw, 65,536 tokens, same day: at TFLA's head (NH
#: 16) and S = 1024 the chunkwise form is also faster (7.35 against 7.55 ms raw, 8.02 against
#: 8.14 normed) for more memory (peak 2.96 GiB against 1.59 raw, 3.98 against 2.60 normed);
#: at xLSTM-7B's head (NH 8, DQK 256, DV 512) it costs 25% (16.38 against 13.12 ms), the
#: price of the accuracy, measured at DQK 128 / DV 256 only (``kernel="parallel"`` takes the
#: faster form). At S <= 512 the
#: parallel form is much faster (5.20 against 7.44 ms, 2026-11-28). Forward only, 2.51 vs 2.49
#: ms at 2048 (the parallel form's peak memory 1.02 GiB vs 1.59), 4.13 vs 2.50 at 4096.
AUTO_PARALLEL_MAX_SEQ = 512
AUTO_PARALLEL_MAX_SEQ_INFERENCE = 2048
#: fp32 inputs take the chunkwise form above this length: its forget-gate sums restart every
#: chunk, where the parallel form's run the whole row, and an fp32 sum of magnitude |F|
#: rounds each decay exponent by about |F| * 6e-8. Measured against fp64 at S = 1024
#: on the CPU (gate distributions of tests/mlstm/test_precision.py): worst output / gradient
#: error 1.3e-4 / 6.4e-4 for the parallel form, 3.0e-6 / 9.0e-5 for the chunkwise form.
AUTO_PARALLEL_MAX_SEQ_FP32 = 128
#: The chunkwise form's default chunk length (benchmarks/RESULTS.md, mLSTM).
DEFAULT_CHUNK = 128


def chunk_length(chunk_size) -> int:
    """``chunk_size`` (None: :data:`DEFAULT_CHUNK`) checked as the docstring states it, a
    Python int that is a power of two from 16 to 4096, whichever form then runs."""
    if chunk_size is None:
        return DEFAULT_CHUNK
    integer = isinstance(chunk_size, (numbers.Integral, torch.SymInt))
    if isinstance(chunk_size, bool) or not integer:
        # The value only for Python's own types: while Dynamo traces, a NumPy integer is a
        # tensor, whose repr it cannot build (the type name alone still names the mistake).
        shown = f" {chunk_size!r}" if type(chunk_size) in (str, float, bool) else ""
        raise TypeError(f"chunk_size must be a Python int (a power of two from 16 to 4096), got "
                        f"{type(chunk_size).__name__}{shown}")
    chunk = int(chunk_size)  # a traced size specialises here: the kernels take a constant
    check_chunk(chunk)
    return chunk


def choose_kernel(kernel: str, seq: int, with_state: bool, training: bool = True,
                  dtype: Optional[torch.dtype] = None) -> str:
    """``"parallel"`` or ``"chunkwise"`` for :func:`mlstm`'s ``kernel`` argument (``seq``:
    S; ``dtype``: the inputs')."""
    check_kernel(kernel)
    if kernel == "parallel" and with_state:
        raise ValueError("kernel='parallel' takes no initial_state and returns no last state: "
                         "use kernel='chunkwise' or 'auto'")
    if kernel != "auto":
        return kernel
    limit = AUTO_PARALLEL_MAX_SEQ if training else AUTO_PARALLEL_MAX_SEQ_INFERENCE
    if dtype == torch.float32:
        limit = AUTO_PARALLEL_MAX_SEQ_FP32
    return "chunkwise" if with_state or seq > limit else "parallel"


def mlstm_with_stats(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    fgate: torch.Tensor, *, norm_weight: Optional[torch.Tensor] = None,
    norm_bias: Optional[torch.Tensor] = None, norm_eps: float = 1e-6, eps: float = 1e-6,
    residual_weight: bool = False, kernel: str = "auto", chunk_size: Optional[int] = None,
    initial_state: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    return_last_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
):
    """:func:`mlstm`, also returning the normaliser and the stabiliser: ``(out, n [B, NH, S],
    m [B, NH, S])`` in fp32 (fp64 for fp64 inputs), then the last state when
    ``return_last_state``. ``n`` and ``m`` carry no gradient."""
    require_tensors((("q", q), ("k", k), ("v", v), ("igate", igate), ("fgate", fgate)))
    normed = norm_weight is not None or norm_bias is not None
    check_initial_state(initial_state)
    chunk = chunk_length(chunk_size)  # whichever form runs: a bad value fails at every S
    if cu_seqlens is not None:
        if initial_state is not None or return_last_state:
            raise ValueError("cu_seqlens takes no initial_state and returns no last state "
                             "(each document starts empty)")
        check_kernel(kernel)
        if kernel == "parallel":
            raise ValueError("packed documents (cu_seqlens) run the chunkwise form, which "
                             "starts each document on its own chunks: use kernel='chunkwise' "
                             "or 'auto'")
        # Every shape before the packed layout, which indexes the inputs by them;
        # cu_seqlens (read against q's B and S) once q has its four axes, so that a packed
        # row in the attention layout is named by S. While Dynamo traces, through an op whose
        # fake function checks (it cannot build the checks' messages in traced Python).
        shapes = (q, k, v, igate, fgate, norm_weight, norm_bias, float(norm_eps), float(eps))
        check = check_inputs_op if torch.compiler.is_compiling() else check_inputs
        if q.dim() != 4:
            check(*shapes)
        check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[-2], q.device)
        check(*shapes)
        check_gates_floating(igate, fgate)
        if q.shape[-2] == 0:  # every document empty: nothing to lay out
            return mlstm_with_stats(q, k, v, igate, fgate, norm_weight=norm_weight,
                                    norm_bias=norm_bias, norm_eps=norm_eps, eps=eps,
                                    residual_weight=residual_weight, kernel="chunkwise",
                                    chunk_size=chunk_size)
        training = _needs_grad(q, k, v, igate, fgate, norm_weight, norm_bias)
        return _packed_documents(q, k, v, igate, fgate, norm_weight, norm_bias, normed,
                                 float(norm_eps), float(eps), bool(residual_weight),
                                 chunk, normed and training, cu_seqlens)
    with_state = initial_state is not None or return_last_state
    training = _needs_grad(q, k, v, igate, fgate, norm_weight, norm_bias,
                           *(initial_state or ()))
    save_h = normed and training
    check_gates_floating(igate, fgate)  # the rest is checked by the op, eagerly and traced
    form = choose_kernel(kernel, q.shape[-2], with_state, training, q.dtype)
    acc = gate_dtype(q.dtype)
    norm = (norm_weight, norm_bias, float(norm_eps), bool(residual_weight))
    if form == "parallel":
        logf = log_forget_op(fgate.to(acc))
        igate_acc = floor_input_gate(igate.to(acc))

        def parallel_cell(v_cols, _, fuse_norm):
            out, _, m_log2, b = mlstm_parallel_op(
                q, k, v_cols, igate_acc, logf, *_fused(norm, fuse_norm), float(eps),
                bool(residual_weight), save_h and fuse_norm)
            return out, m_log2, b, None

        out, m_log2, b, last = _by_value_slices(parallel_cell, v, None, norm)
    else:
        c0, n0, m0 = initial_state if initial_state is not None else (None, None, None)
        rows = (q, k, v, floor_input_gate(igate.to(acc)), fgate.to(acc))
        one_row = q.shape[-2] == 1
        if one_row:
            # Triton compiles a separate variant for a length of exactly 1, which rounds
            # differently from every other length: one pad row (nothing of it reaches the
            # real row or the last state) keeps a one-row call, a one-token document alone,
            # bitwise equal to the same row packed among others.
            rows = documents.pad_rows(*rows, 1)
        logf = log_forget_op(rows[4], chunk)

        def chunkwise_cell(v_cols, c0_cols, fuse_norm):
            out, _, m_log2, b, _, _, _, c_last, n_last, m_last = mlstm_chunkwise_op(
                rows[0], rows[1], v_cols, rows[3], logf, *_fused(norm, fuse_norm)[:2],
                c0_cols, n0, m0, chunk, fuse_norm, float(norm_eps), float(eps),
                bool(residual_weight), save_h and fuse_norm)
            return out, m_log2, b, (c_last, n_last, m_last)

        out, m_log2, b, last = _by_value_slices(chunkwise_cell, rows[2], c0, norm)
        if one_row:
            out = out[:, :1] if normed else out[:, :, :1]
            m_log2, b = m_log2[..., :1], b[..., :1]
    n = torch.maximum(b.abs(), torch.exp2(-m_log2))
    # ln 2 as a literal here: a module-level float becomes a symbolic input under dynamic=True.
    stats = (out, n, m_log2 * 0.6931471805599453)
    return stats + (last,) if return_last_state else stats


def _fused(norm, fuse_norm: bool):
    """The op's ``(norm_weight, norm_bias, normed, norm_eps)`` arguments: the norm when it is
    fused into this call, none otherwise."""
    weight, bias, norm_eps, _ = norm
    return (weight, bias, True, norm_eps) if fuse_norm else (None, None, False, norm_eps)


def _by_value_slices(cell, v, c0, norm):
    """``cell(v_cols, c0_cols, fuse_norm) -> (out, m_log2, b, last_state or None)`` over the
    whole value head when one kernel call takes it (the norm fused when there is one), else
    once per slice of ``MAX_KERNEL_HEAD_DIM`` value columns (xLSTM-7B's DV 512), raw, the
    slices' h concatenated and then normed.

    Exact, not an approximation: h's columns, and the state C's, depend on their own value
    columns only, and the normaliser and stabiliser (``b``, ``m``, the state's n and m) on
    q, k and the gates alone, so every slice computes the same ones and the first slice's
    are kept. Gradients are the sums of the slices' (autograd adds them).
    Cost: each slice recomputes ``q k^T`` and the decays (4/3 of the one-pass FLOPs at DQK
    256 / DV 512), and the norm runs after the cell on the h rounded to v's dtype (one more
    read and write of h than the fused epilogue)."""
    weight, bias, norm_eps, residual_weight = norm
    normed = weight is not None or bias is not None
    dv = v.shape[-1]
    if dv <= MAX_KERNEL_HEAD_DIM or v.dim() != 4:  # a malformed v: the op's check names it
        return cell(v, c0, normed)
    if c0 is not None and (c0.dim() != 4 or c0.shape[-1] != dv):
        raise ValueError(f"initial_state's C must be [B, NH, DQK, DV] with v's DV {dv}, got "
                         f"{tuple(c0.shape)}")
    channels = v.shape[1] * dv
    for name, p in (("norm_weight", weight), ("norm_bias", bias)):
        if p is not None and tuple(p.shape) != (channels,):
            raise ValueError(f"{name} must be [NH * DV] = [{channels}], got {tuple(p.shape)}")
    parts = []
    for start in range(0, dv, MAX_KERNEL_HEAD_DIM):
        cols = slice(start, min(start + MAX_KERNEL_HEAD_DIM, dv))
        parts.append(cell(v[..., cols], None if c0 is None else c0[..., cols], False))
    h = torch.cat([part[0] for part in parts], dim=-1)
    out = multihead_layernorm(h, weight, bias, norm_eps, residual_weight) if normed else h
    _, m_log2, b, last = parts[0]
    if last is not None:
        last = (torch.cat([part[3][0] for part in parts], dim=-1),) + tuple(last[1:])
    return out, m_log2, b, last


def _packed_documents(q, k, v, igate, fgate, norm_weight, norm_bias, normed, norm_eps, eps,
                      residual_weight, chunk, save_h, cu_seqlens):
    """The chunkwise form over packed documents: laid out so that each starts on its own
    chunks (:mod:`compileops.mlstm.documents`), run with the segment table, and gathered
    back. Returns :func:`mlstm_with_stats`'s ``(out, n, m)``."""
    acc = gate_dtype(q.dtype)
    lay = documents.layout(cu_seqlens, q.shape[-2], chunk)
    q_l, k_l, v_l = (documents.to_layout(t, lay, dim=2) for t in (q, k, v))
    igate_l = documents.to_layout(floor_input_gate(igate.to(acc)), lay, dim=-1,
                                   pad="input_gate")
    fgate_l = documents.to_layout(fgate.to(acc), lay, dim=-1, pad="forget_gate")
    logf = log_forget_op(fgate_l, chunk)
    norm = (norm_weight, norm_bias, norm_eps, residual_weight)

    def packed_cell(v_cols, _, fuse_norm):
        out, _, m_log2, b = mlstm_chunkwise_op(
            q_l, k_l, v_cols, igate_l, logf, *_fused(norm, fuse_norm)[:2], None, None, None,
            chunk, fuse_norm, norm_eps, eps, residual_weight, save_h and fuse_norm,
            lay.segments)[:4]
        return out, m_log2, b, None

    out, m_log2, b, _ = _by_value_slices(packed_cell, v_l, None, norm)
    out = documents.from_layout(out, lay, dim=1 if normed else 2)
    m_log2 = documents.from_layout(m_log2, lay, dim=-1)
    b = documents.from_layout(b, lay, dim=-1)
    n = torch.maximum(b.abs(), torch.exp2(-m_log2))
    return out, n, m_log2 * 0.6931471805599453


def mlstm(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    fgate: torch.Tensor, *, norm_weight: Optional[torch.Tensor] = None,
    norm_bias: Optional[torch.Tensor] = None, norm_eps: float = 1e-6, eps: float = 1e-6,
    residual_weight: bool = False, kernel: str = "auto", chunk_size: Optional[int] = None,
    initial_state: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    return_last_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
):
    """The mLSTM cell (stabilised, parallel form), with the multi-head layernorm fused when
    ``norm_weight`` or ``norm_bias`` is given.

    Shapes: ``q, k [B, NH, S, DQK]``, ``v [B, NH, S, DV]``, the gate pre-activations
    ``igate, fgate [B, NH, S]``; ``norm_weight, norm_bias [NH * DV]`` (per channel,
    ``residual_weight=True`` scales by ``1 + weight``).

    Head dims on the Triton kernels: DQK up to 256; DV of any width. Above 256 value
    columns (xLSTM-7B's DV 512) the cell runs once per slice of 256 columns, exact (each
    slice computes the same normaliser and stabiliser), with the norm after it rather than
    fused; each slice recomputes ``q k^T`` (4/3 of the FLOPs at DQK 256 / DV 512).
    Measured on an H200 at xLSTM-7B's head (NH 8, DQK 256, DV 512, bf16, 65,536 tokens,
    compiled forward and backward, normed, ``kernel="auto"``): 16.4 ms at S = 1024 and 15.9
    ms at S = 8192, against 26.7 and 26.9 ms for TFLA's ``xl_chunk`` (benchmarks/RESULTS.md).

    Returns ``[B, S, NH * DV]`` when normed: the layout the xLSTM block consumes next (it
    transposes and reshapes there anyway), so an output gate ``sigmoid(o) * out`` and a cast
    fuse into the compiled kernel's epilogue. Without a norm: the raw ``h [B, NH, S, DV]``.

    Math (docs: ``compileops/mlstm/reference.py``): ``F = cumsum(log sigmoid(fgate))``,
    ``logD_ij = F_i - F_j + igate_j`` (``j <= i``), ``m_i = max_j logD_ij``,
    ``C = q k^T / sqrt(DQK) * exp(logD - m)``, ``h_i = sum_j C_ij v_j / (max(|sum_j C_ij|,
    exp(-m_i)) + eps)``, then per head over DV: ``(h - mean) / sqrt(var + norm_eps)`` times
    the weight, plus the bias. Gate sums, stabilisers and norm statistics are fp32 (fp64 for
    fp64 inputs); the products accumulate in fp32.

    Precision (axis B, against the fp64 reference; tests/mlstm): fp64 and fp32 (IEEE dots)
    within 1e-5 relative (L2) on short rows (S <= 256), except the fp32 forget-gate gradient
    without a norm, within 3e-5 (its reverse cumulative sum cancels large fp32 row and column
    sums). On longer rows fp32 loses more, because a forget-gate sum of size |F| rounds
    each decay exponent by about |F| * 6e-8 (plain fp32 autograd of the reference too): at
    S <= 4096, with forget gates down to N(-1, 1) (tests/mlstm/test_precision.py), the
    chunkwise form within 1e-5 for the output and 1e-3 for the gradients (its sums restart
    every chunk; ``"auto"`` runs fp32 chunkwise above 128 rows), and the parallel form, whose
    sums run the whole row, within 3e-4 and 3e-3 at S <= 1024 and 3e-4 and 2e-2 at
    S <= 4096 (the forget-gate gradient is the largest error of
    both forms; the other gradients stay within 4e-5 chunkwise). bf16 within a
    relative L2 error of 2e-2 for the output and 4e-2 for the gradients (8e-2 chunkwise: its
    states enter the MMAs in bf16) on the tests' short rows. Measured on long rows (an H200,
    B 2, NH 4, DQK 128, DV 256, the gate distributions above, raw and normed;
    benchmarks/RESULTS.md): the output within 2.5e-3 and every gradient but the forget
    gate's within 8.1e-3, both forms, at S 1024 and 8192. The forget gate's gradient is the
    reverse cumulative sum of each position's row sum less its column sum of bf16-rounded
    products. In the chunkwise form (by default) the two sums of each pair come from the
    same rounded product, and what crosses each chunk's end from the chunk's own keys and
    the state entering it, so the pairs that should cancel do: within 7.4e-3 at S 1024 and
    8192. The parallel form, and the chunkwise form with
    ``compileops.mlstm.set_fast_gate_gradients(True)``, sum each kernel's own rounding:
    parallel within 1.5e-2 at S = 1024 and 9.5e-2 at 8192, chunkwise-fast 7.5e-2 and
    1.1e-1. So ``"auto"`` trains 16-bit rows longer than 512 chunkwise. fp16 within a
    relative L2 error of 1e-3 for the output and 4e-3 for the gradients. These 16-bit
    bounds hold for inputs that vary along the sequence;
    where a gradient is small only through cancellation (v, or the gates, the same at every
    position, tiny head dims, a norm that undoes the cell's scale), the kernels' 16-bit
    intermediates can leave most of it rounding residue: property fuzzing on an H200 found q,
    k, v and gate gradients up to 4.8e-2 (fp16) and 4.9e-1 (bf16) off, relative to their size
    or a tenth of the whole gradient's, where the reference backend, which computes in fp32,
    stayed within 2.2e-4 and 2.0e-3 on the same draws. On CUDA the fp64 kernels derive
    ``1 / sqrt(DQK)`` in fp64, but ``eps`` and ``norm_eps`` reach them rounded to fp32 (Triton
    passes Python floats as fp32): on an H200 they stayed within 2.0e-9 relative (output and
    every gradient; DQK 1-100, S up to 130) and are tested to 1e-8, not to fp64's roundoff.
    For fp64's own accuracy (gradient checks), use the reference backend. The Triton kernels are
    deterministic and batch-invariant bitwise, forward and backward; the reference backend
    runs torch's own matmuls, whose bits may change with the batch size (by about 1e-6 in
    fp32).

    Causality (tests/mlstm/test_causality.py): a NaN or Inf at position t (in q, k, v or a
    gate) never reaches an output before t, on both backends and in every form (parallel,
    chunkwise, with a state, packed documents, the recurrent step): those rows stay finite
    and keep the bits they have with that value finite. The outputs it reaches are
    non-finite, except for the
    limits that are numbers (an open forget gate, ``fgate = +Inf``; a closed input gate,
    ``igate = -Inf``; in the recurrent step a closed forget gate too); on the Triton kernels
    a cell that an Inf in v reaches may be NaN where the exact sum is +-Inf. Their cost on
    finite inputs: one check per query tile (1-2% of fw+bw on an H200); a tile whose rows
    came out non-finite runs its key loop a second time. Known limit: on the Triton kernels
    in 16-bit, the rows of a tile are rounded against gate references shared by the tile, so
    a later gate in the tile (a non-finite one included, or a sequence cut inside it) can
    move an earlier row's 16-bit output by a few units of its last place (up to 20 bf16
    units in one case measured, within the bf16 error bound above), and the fp32 normaliser
    of the states by a few units of its last place; fp32 and fp64 keep their bits.
    A closed input gate before anything has entered the cell (``igate = -Inf`` at the first
    rows of a sequence or document, no state carried in) gives ``h = 0`` there, its limit:
    input gates below ``-1e30`` count as ``-1e30`` (``reference.floor_input_gate``), which
    changes no output and no gradient, only the stabiliser ``m`` reported for such rows
    (about -1e30 instead of ``-inf``).

    ``kernel``: ``"parallel"`` (tiles over the causal ``S x S`` square: quadratic in S),
    ``"chunkwise"`` (the parallel kernels within chunks of ``chunk_size`` rows, default 128, a
    power of two from 16 to 4096, plus a ``[DQK, DV]`` fp32 state carried between chunks: linear in S),
    or ``"auto"``: parallel up to ``AUTO_PARALLEL_MAX_SEQ`` rows (512) when a gradient is
    needed (above it the chunkwise form's bf16 forget-gate gradient is the accurate one; at
    S = 1024 it is also faster at DQK 128 / DV 256, and 25% slower at xLSTM-7B's DQK 256 /
    DV 512, where ``kernel="parallel"`` takes the faster, less accurate form; the constant's
    comment gives the figures), and ``AUTO_PARALLEL_MAX_SEQ_INFERENCE`` (2048) when
    not, chunkwise above and whenever a state goes in or out (the crossovers measured on an
    H200); fp32 inputs run chunkwise above ``AUTO_PARALLEL_MAX_SEQ_FP32`` rows (128), for
    precision. Under ``torch.compile(dynamic=True)`` the choice guards on S on one side of that
    length (one recompile when S crosses it).

    States (chunkwise): ``initial_state=(C [B, NH, DQK, DV], n [B, NH, DQK], m [B, NH])``
    in fp32 (fp64 for fp64 inputs), stabilised as in ``compileops.mlstm.recurrent``
    (``C = exp(-m) sum_j exp(F - F_j + igate_j) k_j v_j^T``); ``return_last_state=True``
    returns ``(out, (C, n, m))``. Both carry gradients on every backend (the reference
    backend's through the plain recursion, chunk by chunk). A sequence cut in two calls at a
    chunk boundary, the state carried, gives the one call's result bitwise. S = 0 is
    allowed: an empty output, and the initial state (or the empty one) as the last state.
    Anything but a tuple (or list) of three tensors as ``initial_state`` raises, naming it.
    One known limit, 16-bit inputs with a norm at heads wider than 256 value columns: a norm
    after the cell makes the initial n's gradient cancel to a small value in exact
    arithmetic, and there, where the norm runs after the cell in torch rather than fused,
    the cell only sees h's gradient rounded to 16 bits, so that gradient is rounding noise
    (about 1e-3 of C's gradient, up to a thousand times its own true size). With the norm
    fused (DV up to 256) it is computed from the unrounded gradient; fp32 is exact enough.

    Packed documents: ``cu_seqlens [N + 1]`` (int32 or int64 cumulative ends, on the
    inputs' device; B = 1), chunkwise form only (``kernel="parallel"`` raises; ``"auto"``
    takes the chunkwise form). Each document is moved to start on a chunk boundary, its own
    chunks entered with the empty state (``compileops.mlstm.documents``): a document's
    output, statistics and input gradients are those of the document run alone with the same
    chunk size, whatever the other documents hold (Inf, NaN, gates of any size): bitwise on
    the Triton kernels, to a few ulps on the reference backend (its CPU exp rounds by an
    element's place in the row).
    Cost: at most one more chunk per document (``N * chunk_size`` rows), and a copy of the
    inputs, the outputs and their gradients into and out of that layout (measured on an H200,
    16 documents in 65,536 tokens, bf16, compiled forward and backward: 1.12-1.14x the
    unpacked row's time and 1.6 GiB more peak memory; benchmarks/RESULTS.md). One compile
    serves every packing of the same document count. ``cu_seqlens`` is checked
    (starting at 0, ending at S, never decreasing): on CPU tensors eagerly, naming the
    entry; on CUDA eagerly only under ``compileops.strict_offset_checks()`` (one host sync),
    otherwise, and whenever compiled, on the device with no host sync (a device-side
    assert on CUDA, a ``RuntimeError`` on CPU).

    Memory: the forward keeps the raw h ``[B, NH, S, DV]`` for the norm's backward when a
    gradient is needed (one extra activation of the output's size); nothing ``S x S`` is
    stored. The chunkwise form also keeps the state entering each chunk, ``[DQK, DV]`` in
    the inputs' dtype per (batch, head, chunk): ``DQK / chunk_size`` of v's size, and the
    backward holds the same again for the states' gradients.
    """
    result = mlstm_with_stats(
        q, k, v, igate, fgate, norm_weight=norm_weight, norm_bias=norm_bias,
        norm_eps=norm_eps, eps=eps, residual_weight=residual_weight, kernel=kernel,
        chunk_size=chunk_size, initial_state=initial_state,
        return_last_state=return_last_state, cu_seqlens=cu_seqlens)
    return (result[0], result[3]) if return_last_state else result[0]
