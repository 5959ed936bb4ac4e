"""Rowwise e4m3 quantisation as Inductor IR: a row-amax reduction and a pointwise
scale-and-cast, which Inductor fuses with each other and with whatever produces the rows (a
permutation gather, the SwiGLU derivative of the backward, a cast), so a compiled fp8
product reads its e4m3 operand from one fused kernel and runs no Python. Rows gathered from
fewer source rows (the permuted tokens, each token once per expert it is routed to) are
quantised at the source, and the codes and scales gathered with the rows.

The rule is :mod:`compileops.grouped_linear.fp8`'s, bit for bit as the Triton quantisers of
``compileops/grouped_linear/kernels/fp8.py`` compute it:

* ``scale = amax / 448`` and ``inverse = 448 / amax`` correctly rounded. Triton's ``/`` on
  fp32 is an approximate division, and not every supported torch has Inductor's ``div_rn``;
  both quotients are taken in fp64 and rounded once to fp32, which is the correctly rounded
  fp32 quotient (a quotient of two 24-bit numbers computed to 53 bits rounds to 24 bits
  without a double-rounding error, 53 >= 2 * 24 + 2). One division per row;
* scale 1 below ``MIN_AMAX`` (the row's values come back as zeros), a NaN row stays NaN
  (Inductor's max reduction keeps a NaN, as ``torch.amax`` does);
* ``q = e4m3(clamp(x * inverse, -448, 448))``, rounded to nearest with ties to even: on a
  GPU by the cast itself (``cvt.rn.satfinite``, one instruction for two values); under
  Triton's interpreter (the CPU tests) onto the e4m3 grid in fp32 before the cast (the
  kernels' ``round_to_e4m3_grid``: the interpreter casts some values to e4m3 wrongly, so the
  CPU tests would otherwise test another rule). Here the grid step's power of two
  multiplies instead of dividing: the same exact result.

Why the rule is written here again rather than shared with the Triton quantisers (the one
place where kernel math is): Inductor generates its fused kernels from IR and cannot call a
``@triton.jit`` body inside them; fusing the quantisation into its producers is the point.
``tests/grouped_linear/test_fp8_templates.py`` holds the two to the same bits on the values
where rounding is hardest.

Shapes: ``x [R..., K]`` quantised along its last dim to ``(q [R..., K]`` e4m3, ``scale
[R...]`` fp32): activations, dY times the weight's scales (dX), and the weight ``[G, N, K]``
per output channel.
"""
from __future__ import annotations

import torch

from compileops.grouped_linear.fp8 import E4M3, E4M3_MAX, MIN_AMAX
from compileops.grouped_linear.kernels import fp8 as fp8_kernels
from compileops.lowerings import _compat

#: 1.5 * 2^23: adding and subtracting it rounds an fp32 below 2^22 in magnitude to an
#: integer, ties to even (the kernels' ``round_to_e4m3_grid``).
_ROUNDING_MAGIC = 12582912.0


def _round_to_e4m3_grid(ops, v):
    """fp32 ``v`` (``|v| <= 448`` or NaN) rounded to the nearest e4m3 value, ties to even."""
    i32, f32 = torch.int32, torch.float32

    def c(value, dtype=i32):
        return ops.constant(value, dtype)

    bits = ops.to_dtype_bitcast(v, i32, f32)
    exponent = ops.sub(ops.bitwise_and(ops.bitwise_right_shift(bits, c(23)), c(0xFF)), c(127))
    # e4m3: 3 mantissa bits, smallest normal 2^-6, so the grid step of v's binade is
    # 2^(max(e, -6) - 3); |v| <= 448 keeps that exponent in [-9, 5].
    step_exponent = ops.sub(ops.maximum(exponent, c(-6)), c(3))
    step = ops.to_dtype_bitcast(
        ops.bitwise_left_shift(ops.add(step_exponent, c(127)), c(23)), f32, i32)
    inverse_step = ops.to_dtype_bitcast(
        ops.bitwise_left_shift(ops.sub(c(127), step_exponent), c(23)), f32, i32)
    steps = ops.mul(v, inverse_step)  # exact: a power of two
    magic = c(_ROUNDING_MAGIC, f32)
    rounded = ops.sub(ops.add(steps, magic), magic)
    # v * 0 keeps the sign of a value that rounds to zero, as the cast has it.
    return ops.where(ops.eq(rounded, c(0.0, f32)), ops.mul(v, c(0.0, f32)),
                     ops.mul(rounded, step))


def _scale_and_inverse(ops, amax):
    """``(scale, inverse)`` of a row with largest magnitude ``amax`` (fp32): correctly
    rounded ``amax / 448`` and ``448 / amax``, both 1 below ``MIN_AMAX``."""
    f32, f64 = torch.float32, torch.float64
    flushed = ops.lt(amax, ops.constant(MIN_AMAX, f32))
    one = ops.constant(1.0, f32)
    wide = ops.to_dtype(amax, f64)
    e4m3_max = ops.constant(E4M3_MAX, f64)
    scale = ops.to_dtype(ops.truediv(wide, e4m3_max), f32)
    inverse = ops.to_dtype(ops.truediv(e4m3_max, wide), f32)
    return ops.where(flushed, one, scale), ops.where(flushed, one, inverse)


def _quantise(ops, value, inverse, grid_rounding: bool):
    """e4m3 of ``value * inverse`` clamped to +-448 (a NaN stays NaN). ``grid_rounding``:
    round onto the e4m3 grid in fp32 before the cast (:func:`_round_to_e4m3_grid`), for
    Triton's interpreter; compiled for a GPU the cast alone is the same rule in one
    instruction (``cvt.rn.satfinite``)."""
    scaled = ops.mul(ops.to_dtype(value, torch.float32), inverse)
    bound = ops.constant(E4M3_MAX, torch.float32)
    clamped = ops.minimum(ops.maximum(scaled, ops.neg(bound)), bound)
    clamped = ops.where(ops.ne(scaled, scaled), scaled, clamped)  # a NaN stays NaN
    if grid_rounding:
        clamped = _round_to_e4m3_grid(ops, clamped)
    return ops.to_dtype(clamped, E4M3)


def _row_amax(x, load, dim: int):
    """``max |x|`` along ``dim`` in fp32 (an Inductor reduction, NaN kept); ``load`` reads
    ``x``."""
    ops = _compat.ops()
    magnitude = _compat.pointwise(
        device=x.get_device(), dtype=torch.float32,
        inner_fn=lambda idx: ops.abs(ops.to_dtype(load(idx), torch.float32)),
        ranges=x.get_size())
    return _compat.aten_lowering(torch.ops.aten.amax.default)(magnitude, [dim])


#: At most this many parts per row (each part one more load per reduction step).
_MAX_ROW_PARTS = 8


def _row_parts(width, boundaries=()) -> int:
    """In how many equal parts :func:`quantise_rows` reads a row of ``width`` elements: the
    fewest (at most ``_MAX_ROW_PARTS``) that bring a part within Inductor's persistent
    reduction limit, so the row's amax and its quantisation are one pass over the row,
    preferring a split whose parts each lie inside one piece of a concatenated row (pieces
    starting at ``boundaries``); 1 (the whole row, in a loop when wide) when no split exists
    or the width is symbolic. (Under ``dynamic=True`` the width is still static when it is a
    parameter's dimension, as the products' K and N are: torch.compile keeps parameters'
    shapes static, and the ops' shape checks tie the rows' width to them.)"""
    if not _compat.is_static(width) or int(width) <= _compat.PERSISTENT_ROW_LIMIT:
        return 1
    width = int(width)
    fitting = [parts for parts in range(2, _MAX_ROW_PARTS + 1)
               if width % parts == 0 and width // parts <= _compat.PERSISTENT_ROW_LIMIT]
    aligned = [parts for parts in fitting
               if all(start % (width // parts) == 0 for start in boundaries)]
    return (aligned or fitting or [1])[0]


def _part_loaders(load_x, part: int, parts: int, pieces: list) -> list:
    """One loader per part of the rows of ``x [R..., K]`` (``load(rows + [j])`` for ``j`` in
    the part): where the part lies inside one of the concatenation's ``pieces`` (``[(start,
    buffer)]``, :func:`._compat.concatenated_inputs`), from the buffer that piece was
    computed into, else through ``load_x``. A part that is a whole piece then fuses with the
    piece's producer. ``part``: the parts' width.

    Where Inductor builds a concatenation as a kernel per piece (its choice for CPU
    codegen), the SwiGLU derivative's two halves at Qwen3-30B-A3B's H = 768 and their
    quantisation are one kernel. For a GPU it concatenates two pointwise halves as one
    ``[M, 2H]`` pointwise node, which no part-wide reduction fuses with: the derivative and
    the quantisation stay two kernels there. Lowering the derivative in part-wide pieces
    made them one on an H200 (1-3% off the step at three MoE layers), but the kernel then
    writes the e4m3 copy with the derivative, and the planner allocates the layer's input
    gradient before the gate/up dW instead: 0.03-0.06 GiB more peak (benchmarks/RESULTS.md,
    fp8). Not taken: a default does not trade memory for speed."""

    def from_x(first):
        return lambda idx: load_x([*idx[:-1], first + idx[-1]])

    def from_piece(first):
        for start, buffer in pieces:
            width = int(buffer.get_size()[-1])
            if start <= first and first + part <= start + width:
                load = buffer.make_loader()
                return lambda idx: load([*idx[:-1], first - start + idx[-1]])
        return None

    return [from_piece(p * part) or from_x(p * part) for p in range(parts)]


def _split_row_amax(loaders: list, x, part: int):
    """``max |x|`` along the last dim of ``x [R..., K]``, reduced over one part's width with
    every part's element at each step: the same maximum as over the whole row (a max is
    exact in any order, and a NaN anywhere still gives NaN), in a reduction short enough to
    keep the row in registers."""
    ops = _compat.ops()
    size = list(x.get_size())

    def magnitude_at(rows, reduction_index):
        values = [ops.abs(ops.to_dtype(load([*rows, *reduction_index]), torch.float32))
                  for load in loaders]
        largest = values[0]
        for value in values[1:]:
            largest = ops.maximum(largest, value)
        return largest

    return _compat.inner_row_max(device=x.get_device(), inner_fn=magnitude_at,
                                 ranges=size[:-1], row_width=part)


def _times_group_scales(loader, first: int, column_scale):
    """``loader`` (a part's, its columns starting at ``first``) with each value, in fp32,
    times ``scale[g(row), column]``: ``column_scale = (scale [G, N] IR, row_group [R] IR
    int: the group of each row, G past the last group, G)``."""
    if column_scale is None:
        return loader
    ops = _compat.ops()
    scale, row_group, groups = column_scale
    load_scale, load_group = scale.make_loader(), row_group.make_loader()

    def scaled(idx):
        # Rows past the last offset (group G) take the last group's scales: their dX is
        # zero whatever they hold.
        group_id = ops.minimum(load_group([idx[0]]),
                               ops.constant(groups - 1, row_group.get_dtype()))
        group = _compat.indirect_index(group_id, groups)
        value = ops.to_dtype(loader(idx), torch.float32)
        return ops.mul(value, load_scale([group, first + idx[-1]]))

    return scaled


def quantise_rows(x, column_scale=None):
    """``x [R..., K]`` (IR, 16- or 32-bit) -> ``(q [R..., K]`` e4m3, ``scale [R...]`` fp32),
    both contiguous buffers, one scale per row of K. ``column_scale``: ``(s [G, K], group
    [R], G)`` for a 2-D ``x``: the rows quantised are ``x[r] * s[group[r]]`` in fp32 (dX's
    operand, :func:`compileops.grouped_linear.fp8.scale_gradient_rows`), computed in the
    same kernel.

    A row wider than Inductor's persistent-reduction limit is read in :func:`_row_parts`
    parts: the amax reduces over one part's width, and each part of ``q`` is its own
    pointwise node of that width, written into its slice of ``q``. Inductor then fuses the
    amax, every part's quantisation and the producer of the rows (a gather, a cast; the
    pieces of a concatenation built a kernel per piece, read where they were computed) into
    one persistent kernel that reads each row once, where a looped reduction over the whole
    row reads it twice.

    Gathered rows that are also written to memory for another consumer (an operand of
    another op of this library, or a tensor saved for the backward: dY permuted to the
    experts' rows and kept for the bf16 down dW, tokens computed inside the permutation and
    saved for the gate/up dW) are realized in the same part-wide pieces
    (:func:`._compat.realize_gathered_in_parts`), so that kernel writes them too; a
    whole-row copy does not fuse with a reduction over part of a row."""
    ops = _compat.ops()
    device, size = x.get_device(), list(x.get_size())
    # Rows wider than the persistent limit cannot be quantised in the kernel that writes
    # the kept gathered copy (a whole-row pointwise node does not fuse with a reduction
    # over a part of the row); narrower ones are, in one kernel, which this would split.
    wide = _compat.is_static(size[-1]) and int(size[-1]) > _compat.PERSISTENT_ROW_LIMIT
    gather = _compat.row_gather(x) if column_scale is None and wide else None
    if gather is not None:
        return _quantise_then_gather(gather, device, size)
    pieces = _compat.concatenated_inputs(x, len(size) - 1) or []
    parts = _row_parts(size[-1], [start for start, _ in pieces])
    if wide and parts > 1 and not pieces and _compat.kept_beside(x):
        # Gathered rows that another op reads from memory (dY permuted to the experts'
        # rows, kept for the bf16 down dW): written in part-wide pieces, the kernel that
        # quantises them writes them too, where whole rows were a kernel of their own.
        pieces = _compat.realize_gathered_in_parts(x, int(size[-1]) // parts) or []
    # Rows gathered into a buffer the graph also keeps (the permuted tokens, saved for dW)
    # are gathered again here rather than read back: one kernel reads the source rows.
    load_x = _compat.gather_recomputed(x) or x.make_loader()
    if parts == 1:
        part = size[-1]
        loaders = [_times_group_scales(load_x, 0, column_scale)]
        if column_scale is None:
            amax = _row_amax(x, load_x, len(size) - 1)
        else:
            amax = _split_row_amax(loaders, x, part)
    else:
        part = int(size[-1]) // parts
        loaders = [_times_group_scales(load, p * part, column_scale)
                   for p, load in enumerate(_part_loaders(load_x, part, parts, pieces))]
        amax = _split_row_amax(loaders, x, part)
    load_amax = amax.make_loader()
    # The cast rounds by itself when compiled for a GPU; Triton's interpreter needs the grid.
    grid_rounding = device.type != "cuda" or bool(fp8_kernels.GRID_ROUNDING)

    def q_of_part(load):
        def q_at(idx):
            _, inverse = _scale_and_inverse(ops, load_amax(idx[:-1]))
            return _quantise(ops, load(idx), inverse, grid_rounding)
        return _compat.pointwise(device=device, dtype=E4M3, inner_fn=q_at,
                                 ranges=[*size[:-1], part])

    def scale_at(idx):
        return _scale_and_inverse(ops, load_amax(idx))[0]

    q_parts = [q_of_part(load) for load in loaders]
    q = q_parts[0] if parts == 1 else _compat.concat_parts(q_parts, len(size) - 1)
    scale = _compat.pointwise(device=device, dtype=torch.float32, inner_fn=scale_at,
                              ranges=size[:-1])
    return _compat.require_contiguous(q), _compat.require_contiguous(scale)


def _quantise_then_gather(gather, device, size):
    """``quantise_rows`` of ``x [M, K]`` that only copies rows of a source ``[T, K]`` into
    more rows than it has (``gather``, :class:`._compat.RowGather`: the MoE layer's permuted
    tokens, each token once per expert it is routed to): the ``T`` source rows are quantised
    (a persistent reduction over ``T`` rows), then codes and scales are gathered as ``x``
    is.

    Each row's quantisation depends on that row alone, so the gathered codes are the bits
    the gathered rows' quantisation gives. The gather of the codes has the index of ``x``'s
    own gather and fuses with it, one kernel writing both (``x`` is kept, for dW): the
    reduction reads ``T`` rows instead of ``M``, and the ``M`` gathered rows are read once,
    where quantising them as gathered was a kernel of its own that gathered them again.

    The source must be a buffer of its own (a graph input, or written by a kernel of its
    own); where Inductor inlines the tokens' producer (a norm) into the gather, the gathered
    rows are computed, not copied, and are quantised as gathered, the kept rows written by
    the same kernel (:func:`quantise_rows`)."""
    source_q, source_scale = quantise_rows(gather.source)
    q = _compat.pointwise(device=device, dtype=E4M3, inner_fn=gather.gathered_from(source_q),
                          ranges=size)
    scale = _compat.pointwise(device=device, dtype=torch.float32,
                              inner_fn=gather.rows_gathered_from(source_scale),
                              ranges=size[:-1])
    return _compat.require_contiguous(q), _compat.require_contiguous(scale)
