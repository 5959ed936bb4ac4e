"""Where a tile's rows are: group bounds read from the device offsets, the flat tile spaces
of the two persistent schedules, and the dW ticket counter. ``@triton.jit`` helpers only.

``offs_ptr`` is always the group offsets, int32 ``[G]``, contiguous: ``offs[g]`` is the
end row of group ``g`` (cumulative), so group ``g`` owns rows ``[offs[g-1], offs[g])``.
Offsets are clamped per group (``start = clamp(offs[g-1], 0, M)``, ``end = clamp(offs[g],
start, M)``): bad offsets never cause an out-of-bounds access, the result for them is
unspecified. The rows past ``offs[G-1]`` form a virtual group ``G``, "the tail".
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def group_rows(offs_ptr, g, G, M):
    """Rows ``[start, end)`` of group ``g`` (``g == G``: the tail ``[offs[G-1], M)``), clamped;
    ``offs_ptr``: int32 ``[G]``, contiguous (see the module docstring)."""
    prev = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)  # scalar
    start = tl.minimum(tl.maximum(prev, 0), M)
    raw = tl.load(offs_ptr + g, mask=g < G, other=M)  # scalar
    end = tl.minimum(tl.maximum(raw, start), M)
    return start, end


@triton.jit
def group_bounds(offs_ptr, G, M, G_BLOCK: tl.constexpr):
    """:func:`group_rows` for every lane at once: ``(lanes, start, end)``, each ``[G_BLOCK]``;
    lane ``G`` is the tail ``[offs[G-1], M)``; lanes past it hold no group (callers mask them)."""
    lanes = tl.arange(0, G_BLOCK)
    prev = tl.load(offs_ptr + lanes - 1, mask=(lanes > 0) & (lanes <= G), other=0)  # [G_BLOCK]
    start = tl.minimum(tl.maximum(prev, 0), M)
    raw = tl.load(offs_ptr + lanes, mask=lanes < G, other=M)  # [G_BLOCK]
    end = tl.minimum(tl.maximum(raw, start), M)
    return lanes, start, end


# ---------------------------------------------------------------------------------------
# M-jagged tile space: M-tiles numbered group after group, then N-tiles


@triton.jit
def group_tile_table(offs_ptr, G, M, BLOCK_M: tl.constexpr, G_BLOCK: tl.constexpr):
    """Per-group M-tile prefix sums, read once per program from the device offsets.

    Lane ``g < G`` is group g, lane ``G`` the tail rows past ``offs[G-1]`` (written as zeros),
    lanes past ``G`` are empty. Returns ``(tile_end [G_BLOCK], total_m)``: ``tile_end[g]`` is
    the number of M-tiles in groups ``0..g`` (inclusive prefix sum), ``total_m`` the total.
    ``G_BLOCK`` is a power of two > G.
    """
    lanes, start, end = group_bounds(offs_ptr, G, M, G_BLOCK)
    m_tiles = tl.where(lanes <= G, tl.cdiv(end - start, BLOCK_M), 0)
    tile_end = tl.cumsum(m_tiles, axis=0)
    return tile_end, tl.sum(m_tiles, axis=0)


@triton.jit
def locate_tile(t, tile_end, total_m, num_n, offs_ptr, G, M,
                GROUP_M: tl.constexpr, G_BLOCK: tl.constexpr):
    """Flat tile ``t`` of the ``total_m x num_n`` tile space -> ``(g, start, end, tile_m,
    tile_n)``: group g's rows ``[start, end)`` and the tile's place in that group.

    M-tiles are numbered group after group (:func:`group_tile_table`), then ``GROUP_M``
    M-tiles are swept across all N-tiles before moving on (L2 reuse of A rows and of B_g).
    Finding the group is a compare-and-count over the G lanes: no per-group loop, no extra
    launch.
    """
    per_super = GROUP_M * num_n
    first_m = (t // per_super) * GROUP_M
    rows_here = tl.minimum(total_m - first_m, GROUP_M)
    m_idx = first_m + (t % per_super) % rows_here
    tile_n = (t % per_super) // rows_here
    g = tl.sum((tile_end <= m_idx).to(tl.int32), axis=0)
    lanes = tl.arange(0, G_BLOCK)
    group_first = tl.sum(tl.where(lanes == g - 1, tile_end, 0), axis=0)
    start, end = group_rows(offs_ptr, g, G, M)
    return g, start, end, m_idx - group_first, tile_n


# ---------------------------------------------------------------------------------------
# dW (K-jagged) tile space: G x N-tiles x K-tiles, group by group


@triton.jit
def kjagged_tile_coords(rest, num_n, num_k, GROUP_N: tl.constexpr):
    """Index ``rest`` in ``[0, num_n * num_k)`` of a group's dW tiles -> ``(tile_n, tile_k)``:
    K-tile fastest for ``GROUP_N == 1``; else super-blocks of ``GROUP_N`` N-tiles (the last
    one may be narrower), N-tile fastest inside each. A bijection either way."""
    if GROUP_N == 1:
        return rest // num_k, rest % num_k
    per_super = GROUP_N * num_k
    first_n = (rest // per_super) * GROUP_N
    n_here = tl.minimum(num_n - first_n, GROUP_N)
    within = rest % per_super
    return first_n + within % n_here, within // n_here


@triton.jit
def kjagged_program_chunks(offs_ptr, pid, per_group, G, M, NUM_PROGS: tl.constexpr,
                           BLOCK_M: tl.constexpr, G_BLOCK: tl.constexpr):
    """Row chunks program ``pid`` reduces under the static schedule (tiles ``pid, pid +
    NUM_PROGS, ...``; a tile of an empty group counts one chunk): one vector pass over the
    G groups, no loop over the tiles."""
    lanes, start, end = group_bounds(offs_ptr, G, M, G_BLOCK)
    first_tile = lanes * per_group
    # The program's first tile in group g: the least t >= first_tile with t % NUM_PROGS == pid.
    mine = first_tile + (pid - first_tile % NUM_PROGS + NUM_PROGS) % NUM_PROGS
    tiles = tl.maximum(tl.cdiv(first_tile + per_group - mine, NUM_PROGS), 0)
    chunks = tl.maximum(tl.cdiv(end - start, BLOCK_M), 1)
    return tl.sum(tl.where(lanes < G, tiles * chunks, 0), axis=0)


@triton.jit
def kjagged_tile_state(t, per_group, num_n, num_k, offs_ptr, G, M, GROUP_N: tl.constexpr):
    """Static-schedule tile ``t`` -> ``(g, tile_n, tile_k, start, end)``; past the last tile
    the group index is clamped (its state is never used)."""
    g = tl.minimum(t // per_group, G - 1)
    tile_n, tile_k = kjagged_tile_coords(t % per_group, num_n, num_k, GROUP_N)
    start, end = group_rows(offs_ptr, g, G, M)
    return g, tile_n, tile_k, start, end


# ---------------------------------------------------------------------------------------
# Dynamic dW schedule (Config.dynamic_tiles): an int32 ticket counter, zeroed per launch


@triton.jit
def claim_ticket(ticket_ptr, DYNAMIC_TILES: tl.constexpr, ASM_TICKET: tl.constexpr,
                 LANES: tl.constexpr):
    """Issues ``atomicAdd(ticket_ptr, 1)`` for this program's next tile; read the ticket with
    :func:`ticket_value`. ``ticket_ptr``: int32 ``[1]``. A relaxed integer atomic: it only
    hands out tile numbers, and which program computes a tile never changes the tile's bits.

    ``ASM_TICKET`` (NVIDIA GPUs): one thread issues the atomic through inline PTX into a
    ``[LANES]`` tensor (one lane per thread, ``LANES = 32 * num_warps``; the other lanes
    hold 0), and the value is only gathered (``tl.max``) where it is needed, so its round
    trip to L2 overlaps the work in between (the dW epilogue). ``tl.atomic_add`` on a
    scalar would broadcast the result through shared memory behind a barrier right away,
    stalling every warp for the round trip once per tile. The interpreter (no inline asm)
    takes ``tl.atomic_add``. ``DYNAMIC_TILES`` false: no atomic, returns 0."""
    ticket = 0
    if DYNAMIC_TILES:
        if ASM_TICKET:
            lane = tl.arange(0, LANES)
            ticket = tl.inline_asm_elementwise(
                "{ .reg .pred leader; setp.eq.s32 leader, $2, 0; mov.u32 $0, 0; "
                "@leader atom.relaxed.gpu.global.add.u32 $0, [$1], 1; }",
                "=r,l,r", [ticket_ptr + lane * 0, lane], dtype=tl.int32, is_pure=False,
                pack=1)
        else:
            ticket = tl.atomic_add(ticket_ptr, 1, sem="relaxed")
    return ticket


@triton.jit
def ticket_value(ticket, ASM_TICKET: tl.constexpr):
    """The counter value a :func:`claim_ticket` handle received (a scalar)."""
    value = ticket
    if ASM_TICKET:
        value = tl.max(ticket, axis=0)
    return value
