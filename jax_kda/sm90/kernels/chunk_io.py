"""Moving a chunk's arrays between global memory and bf16 wgmma operand images, for the
per-chunk kernels of two warpgroups (256 threads): float32 or bfloat16 matrices (row-major, in
the state scan's operand order, or [64, 64] pair matrices transposed) into images 16 bytes a
thread a pass (stored 8 or 16 bytes at a time where the image keeps them together),
accumulators out as pairs."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from jax_kda.constants import HEAD_DIM, SCAN_CHUNK
from jax_kda.sm90.kernels.wgmma import row_piece, store_piece

ROWS = SCAN_CHUNK
NTHREADS = 256  # two warpgroups


def pair_at(row: cute.Tensor, n):
    """Elements n, n + 1 (n even) of a row in global memory (float32 or bf16) as one 8- or
    4-byte vector."""
    pair_bytes = 2 * row.element_type.width // 8
    return cute.make_tensor((row.iterator + n).align(pair_bytes), cute.make_layout(2))


STAGE_PAD = 8  # bf16 elements (16 bytes) of padding a staged row


def stage_rows(raw, byte_off: int, cols: int):
    """A plain [64, cols] bf16 array at raw + byte_off (an Int32 shared-memory pointer) for
    results on their way out, rows padded by 16 bytes: a warpgroup's accumulator pairs (8
    rows x 4 column pairs a warp) land in distinct banks, and each row stays 16-byte aligned
    for the vector loads that take it out."""
    return cute.make_tensor(
        cute.recast_ptr(raw + byte_off // 4, dtype=BFloat16),
        cute.make_layout((ROWS, cols), stride=(cols + STAGE_PAD, 1)),
    )


@cute.jit
def stage_pairs(acc: cute.Tensor, coords: cute.Tensor, stage: cute.Tensor, col0):
    """A warpgroup's float32 accumulator into stage[i, col0 + n] as bf16 (rounded once); a
    thread's columns n, n + 1 at e, e + 1 as one 4-byte pair."""
    pair = cute.make_rmem_tensor((2,), Float32)
    for e in cutlass.range_constexpr(0, cute.size(acc), 2):
        i, n = coords[e]
        pair[0] = acc[e]
        pair[1] = acc[e + 1]
        pair_at(stage[i, None], col0 + n).store(pair.load().to(BFloat16))


@cute.jit
def store_pairs(acc: cute.Tensor, coords: cute.Tensor, out: cute.Tensor, col0, negate: bool):
    """A warpgroup's float32 accumulator into out[i, col0 + n] ([rows, cols] in global memory,
    float32 or bfloat16: the values rounded once), (-) its values; a thread holds columns n,
    n + 1 (n even) at e, e + 1, stored as one 8- or 4-byte pair."""
    pair = cute.make_rmem_tensor((2,), Float32)
    for e in cutlass.range_constexpr(0, cute.size(acc), 2):
        i, n = coords[e]
        pair[0] = acc[e]
        pair[1] = acc[e + 1]
        if cutlass.const_expr(negate):
            pair[0] = -acc[e]
            pair[1] = -acc[e + 1]
        pair_at(out[i, None], col0 + n).store(pair.load().to(out.element_type))


@cute.jit
def to_image(
    image,
    m_x: cute.Tensor,
    tid,
    rows: cutlass.Constexpr[int],
    cols: cutlass.Constexpr[int],
    col0: cutlass.Constexpr[int] = 0,
    negate: cutlass.Constexpr = False,
):
    """A [rows, cols] row-major matrix (float32 or bfloat16), (-) its values, into columns
    [col0, col0 + cols) of its bf16 image, 16 bytes a thread a pass, every load issued before
    the first store (wgmma.store_piece: 8 or 16 bytes a store)."""
    per = 16 * 8 // m_x.element_type.width  # elements in 16 bytes: 4 float32 or 8 bf16
    passes = rows * cols // (NTHREADS * per)
    r_x = cute.make_rmem_tensor((passes, per), m_x.element_type)
    for p in cutlass.range_constexpr(passes):
        e = (p * NTHREADS + tid) * per
        r_x[p, None].store(row_piece(m_x[e // cols, None], e % cols, per).load())
    for p in cutlass.range_constexpr(passes):
        e = (p * NTHREADS + tid) * per
        values = r_x[p, None].load().to(Float32)
        if cutlass.const_expr(negate):
            values = -values
        store_piece(image, e // cols, col0 + e % cols, values.to(BFloat16), False)


def scan_order_offset(i, c):
    """Offset of element (row i, column c) of a [64, 128] chunk array in the tensor-core state
    scan's operand order (backend.state_scan_operands, the chunk core's w_img and kd_img): 8 x 8
    core matrices, rows within them, then down the rows, then across:
    ((c // 8) 8 + i // 8) 64 + (i % 8) 8 + c % 8."""
    return ((c // 8) * (ROWS // 8) + i // 8) * 64 + (i % 8) * 8 + c % 8


def scan_order_position(o):
    """(row i, column c) of the element at offset o (a multiple of 8) in the scan's operand
    order: scan_order_offset's inverse for the first of 8 neighbouring columns."""
    core = o // 64
    return (core % (ROWS // 8)) * 8 + (o % 64) // 8, (core // (ROWS // 8)) * 8


@cute.jit
def scan_order_image(
    image,
    m_flat: cute.Tensor,
    tid,
    col0: cutlass.Constexpr[int] = 0,
    negate: cutlass.Constexpr = False,
):
    """A [64, 128] bfloat16 chunk array stored in the scan's operand order (m_flat: its 8192
    elements, scan_order_offset's order), (-) its values, into columns [col0, col0 + 128) of
    a K-major image: each 16-byte piece is 8 neighbouring columns of one row; every load
    issued before the first store."""
    per = 8
    passes = ROWS * HEAD_DIM // (NTHREADS * per)
    r_x = cute.make_rmem_tensor((passes, per), BFloat16)
    for p in cutlass.range_constexpr(passes):
        o = (p * NTHREADS + tid) * per
        r_x[p, None].store(row_piece(m_flat, o, per).load())
    for p in cutlass.range_constexpr(passes):
        i, c = scan_order_position((p * NTHREADS + tid) * per)
        values = r_x[p, None].load()
        if cutlass.const_expr(negate):
            values = (-values.to(Float32)).to(BFloat16)
        store_piece(image, i, col0 + c, values, False)


@cute.jit
def transposed_bf16_pairs_image(image, m_a: cute.Tensor, tid):
    """A [64, 64] bfloat16 row-major pair matrix, transposed, into its image:
    image[i, j] = m_a[j, i]."""
    per = 8
    passes = ROWS * ROWS // (NTHREADS * per)
    r_a = cute.make_rmem_tensor((passes, per), BFloat16)
    for p in cutlass.range_constexpr(passes):
        e = (p * NTHREADS + tid) * per
        r_a[p, None].store(row_piece(m_a[e // ROWS, None], e % ROWS, per).load())
    for p in cutlass.range_constexpr(passes):
        e = (p * NTHREADS + tid) * per
        for x in cutlass.range_constexpr(per):
            image[e % ROWS + x, e // ROWS] = r_a[p, x]


@cute.jit
def token_rows_image(image, m_x: cute.Tensor, row0, count, tid):
    """A chunk's rows of a bf16 token array (m_x: [T, 128], one head's view) into its bf16
    image [64, 128]: row i < count from token row0 + i, the others zero; 16 bytes a thread a
    pass."""
    per = 8  # bf16 elements in 16 bytes
    passes = ROWS * HEAD_DIM // (NTHREADS * per)
    r_x = cute.make_rmem_tensor((passes, per), BFloat16)
    for p in cutlass.range_constexpr(passes):
        e = (p * NTHREADS + tid) * per
        i = e // HEAD_DIM
        r_x[p, None].fill(0.0)
        if i < count:
            r_x[p, None].store(row_piece(m_x[row0 + i, None], e % HEAD_DIM, per).load())
    for p in cutlass.range_constexpr(passes):
        e = (p * NTHREADS + tid) * per
        store_piece(image, e // HEAD_DIM, e % HEAD_DIM, r_x[p, None].load(), False)
