"""Moving a chunk's float32 arrays between global memory and bf16 wgmma operand images, for the
per-chunk kernels of two warpgroups (256 threads): matrices (as they are, or [64, 64] pair
matrices transposed) into images 16 bytes a thread a pass (stored 8 or 16 bytes at a time where
the image keeps them together), accumulators out as 8-byte pairs."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from jax_kda.constants import HEAD_DIM, SCAN_CHUNK
from jax_kda.sm90.kernels.wgmma import row_piece, store_piece, vec4

ROWS = SCAN_CHUNK
NTHREADS = 256  # two warpgroups


def pair_at(row: cute.Tensor, n):
    """Elements n, n + 1 (n even) of a float32 row in global memory as one 8-byte vector."""
    return cute.make_tensor((row.iterator + n).align(8), cute.make_layout(2))


@cute.jit
def store_pairs(acc: cute.Tensor, coords: cute.Tensor, out: cute.Tensor, col0, negate: bool):
    """A warpgroup's float32 accumulator into out[i, col0 + n] (float32 [rows, cols] in global
    memory), (-) its values; a thread holds columns n, n + 1 (n even) at e, e + 1, stored as
    one 8-byte pair."""
    pair = cute.make_rmem_tensor((2,), Float32)
    for e in cutlass.range_constexpr(0, cute.size(acc), 2):
        i, n = coords[e]
        pair[0] = acc[e]
        pair[1] = acc[e + 1]
        if cutlass.const_expr(negate):
            pair[0] = -acc[e]
            pair[1] = -acc[e + 1]
        pair_at(out[i, None], col0 + n).store(pair.load())


@cute.jit
def to_image(
    image,
    m_x: cute.Tensor,
    tid,
    rows: cutlass.Constexpr[int],
    cols: cutlass.Constexpr[int],
    col0: cutlass.Constexpr[int] = 0,
    negate: cutlass.Constexpr = False,
    vector_stores: cutlass.Constexpr = True,
):
    """A [rows, cols] float32 row-major matrix, (-) its values, into columns [col0, col0 +
    cols) of its bf16 image, 16 bytes a thread a pass; stored 8 bytes at a time
    (wgmma.store_piece), or element by element with vector_stores=False (the chunk-outputs kernel
    until its vector stores have run on a GPU)."""
    passes = rows * cols // (NTHREADS * 4)
    r_x = cute.make_rmem_tensor((passes, 4), Float32)
    for p in cutlass.range_constexpr(passes):
        e = (p * NTHREADS + tid) * 4
        r_x[p, None].store(vec4(m_x[e // cols, None].iterator + e % cols).load())
    for p in cutlass.range_constexpr(passes):
        e = (p * NTHREADS + tid) * 4
        if cutlass.const_expr(vector_stores):
            values = r_x[p, None].load()
            if cutlass.const_expr(negate):
                values = -values
            store_piece(image, e // cols, col0 + e % cols, values.to(BFloat16), False)
        else:
            for x in cutlass.range_constexpr(4):
                value = r_x[p, x]
                if cutlass.const_expr(negate):
                    value = -value
                image[e // cols, col0 + e % cols + x] = value.to(BFloat16)


@cute.jit
def transposed_pairs_image(image, m_a: cute.Tensor, tid):
    """A [64, 64] float32 row-major pair matrix, transposed, into its bf16 image:
    image[i, j] = m_a[j, i]."""
    passes = ROWS * ROWS // (NTHREADS * 4)
    r_a = cute.make_rmem_tensor((passes, 4), Float32)
    for p in cutlass.range_constexpr(passes):
        e = (p * NTHREADS + tid) * 4
        r_a[p, None].store(vec4(m_a[e // ROWS, None].iterator + e % ROWS).load())
    for p in cutlass.range_constexpr(passes):
        e = (p * NTHREADS + tid) * 4
        for x in cutlass.range_constexpr(4):
            image[e % ROWS + x, e // ROWS] = r_a[p, x].to(BFloat16)


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
