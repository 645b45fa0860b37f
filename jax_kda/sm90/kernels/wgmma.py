"""The kernels' shared Hopper building blocks: one-warpgroup bf16 wgmma, its shared-memory operand
images, and the bf16 hi/lo split that makes a product about float32-accurate.

A float32 product A B runs as three bf16 products, A_hi B_hi + A_lo B_hi + A_hi B_lo (relative
error about 2^-16, float32 accumulation). An operand image holds both halves along K: K-blocks
[0, k_blocks) are the high parts, [k_blocks, 2 k_blocks) the low ones. With passes = 1 (the
single-pass variants: one bf16 product, about 2^-9 relative per operand; benchmarks.
precision_study measures what that costs) an image holds the bf16 value alone.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.warpgroup as warpgroup
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32


def bf16_tiled_mma(tile_mn, a_source, b_mn_major: bool = False, a_mn_major: bool = False):
    """One-warpgroup wgmma, bf16 operands, float32 accumulator; A from shared memory
    (OperandSource.SMEM) or registers (OperandSource.RMEM), K-major or (shared memory only)
    M-major with a_mn_major; B K-major, or N-major with b_mn_major (an image written by its N
    index: image_layout(..., mn_major=True))."""
    major = cute.nvgpu.OperandMajorMode
    return sm90_utils.make_trivial_tiled_mma(
        BFloat16,
        BFloat16,
        major.MN if a_mn_major else major.K,
        major.MN if b_mn_major else major.K,
        Float32,
        (1, 1, 1),
        tile_mn,
        a_source,
    )


def image_layout(n: int, k: int, mn_major: bool = False):
    """A wgmma operand image (rows n, K = k) in shared memory, swizzled: K-major, or N-major
    (consecutive n adjacent: threads that own one n each write it without conflicts). The
    widest swizzle (128, 64 or 32 bytes) whose atom tiles the major extent exactly, so the
    image takes n * k elements and no more (a 128-byte atom pads K = 32 or 160 to 64 or 192)."""
    kind = warpgroup.SmemLayoutAtomKind
    major = n if mn_major else k
    for width, mn_kind, k_kind in ((64, kind.MN_SW128, kind.K_SW128),
                                   (32, kind.MN_SW64, kind.K_SW64),
                                   (16, kind.MN_SW32, kind.K_SW32)):  # fmt: skip
        if major % width == 0:
            atom = warpgroup.make_smem_layout_atom(mn_kind if mn_major else k_kind, BFloat16)
            return cute.tile_to_shape(atom, (n, k), order=(1, 0) if mn_major else (0, 1))
    raise ValueError(f"an operand image's major extent is a multiple of 16, not {major}")


def inter_image_layout(n: int, k: int, mn_major: bool = False):
    """A wgmma operand image (rows n, K = k) without swizzle (8 x 8 core matrices): 8
    consecutive K elements (K-major) or n rows (N-major) are one contiguous 16-byte piece, so
    cp.async can fill it from a plain row-major array."""
    kind = warpgroup.SmemLayoutAtomKind
    atom = warpgroup.make_smem_layout_atom(kind.MN_INTER if mn_major else kind.K_INTER, BFloat16)
    return cute.tile_to_shape(atom, (n, k), order=(1, 0) if mn_major else (0, 1))


def view(raw_i32_ptr, byte_off: int, comp_layout, nstages: int = 0, stage_bytes: int = 0):
    """bf16 (swizzled) view of a composed image layout placed at raw + byte_off (an Int32
    shared-memory pointer, the image 1024-byte aligned); with nstages > 0 an extra trailing
    stage mode of stride stage_bytes."""
    ptr = cute.recast_ptr(raw_i32_ptr + byte_off // 4, comp_layout.inner, dtype=BFloat16)
    outer = comp_layout.outer
    if nstages > 0:
        outer = cute.append(outer, cute.make_layout(nstages, stride=stage_bytes // 2))
    return cute.make_tensor(ptr, outer)


def vec4(ptr):
    """Four 4-byte elements at ptr as one 16-byte vector. Pointer.align(16) rounds the address
    up to 16 bytes (a no-op for the 16-byte-aligned addresses every caller passes) and returns
    a pointer of that known alignment, so the access is one vector; it also drops a shared
    memory pointer's swizzle, so it serves plain arrays, not swizzled operand images."""
    return cute.make_tensor(ptr.align(16), cute.make_layout(4))


def row_piece(row: cute.Tensor, c, n: int):
    """Elements c .. c + n of a contiguous row (global memory, or a plain row-major array in
    shared memory) as one 16-byte vector: c a multiple of n, the row 16-byte aligned (as for
    vec4: align rounds up, a no-op there)."""
    return cute.make_tensor((row.iterator + c).align(16), cute.make_layout(n))


def acc_to_a_operand(mma: cute.TiledMma, acc: cute.Tensor, m: int, kdim: int) -> cute.Tensor:
    """bf16 copy of an m64nN float32 accumulator as the register A operand (K = kdim): the C and
    A TV layouts of a one-warpgroup wgmma are the same."""
    frag = mma.make_fragment_A(mma.partition_shape_A((m, kdim)))
    cute.make_tensor(frag.iterator, acc.layout).store(acc.load().to(BFloat16))
    return frag


def split_a_operands(mma: cute.TiledMma, acc: cute.Tensor, m: int, kdim: int, negate=False):
    """(hi, lo) bf16 register A operands (K = kdim) of an m64 float32 accumulator,
    hi + lo = (-)acc to about 2^-16."""
    hi = mma.make_fragment_A(mma.partition_shape_A((m, kdim)))
    lo = mma.make_fragment_A(mma.partition_shape_A((m, kdim)))
    x = acc.load()
    if cutlass.const_expr(negate):
        x = -x
    x_hi = x.to(BFloat16)
    cute.make_tensor(hi.iterator, acc.layout).store(x_hi)
    cute.make_tensor(lo.iterator, acc.layout).store((x - x_hi.to(Float32)).to(BFloat16))
    return hi, lo


@cute.jit
def put_split(image: cute.Tensor, row, col, half: cutlass.Constexpr[int], x: Float32):
    """x as bf16 hi at (row, col) and lo at (row, half + col) of an image."""
    x_hi = x.to(BFloat16)
    image[row, col] = x_hi
    image[row, half + col] = (x - x_hi.to(Float32)).to(BFloat16)


@cute.jit
def load_f32(row: cute.Tensor, c, n: cutlass.Constexpr[int]):
    """Elements c .. c + n - 1 of a 16-byte-aligned contiguous shared-memory row (float32 or
    bf16; c a multiple of n) as a float32 vector, in 16-byte loads."""
    x = cute.make_rmem_tensor((n,), row.element_type)
    cute.autovec_copy(cute.make_tensor((row.iterator + c).align(16), cute.make_layout(n)), x)
    return x.load().to(Float32)


@cute.jit
def put_piece(image: cute.Tensor, row, col, x, along_rows: cutlass.Constexpr[bool],
              half: cutlass.Constexpr[int], passes: cutlass.Constexpr[int] = 3):  # fmt: skip
    """n float32 values x (a vector) into an operand image by put_operand's rule (three passes:
    bf16 hi at the column, lo `half` columns on; one: bf16 values): along_rows, at rows row ..
    row + n - 1 of column col (an N-major image; row a multiple of n), else at columns col ..
    col + n - 1 of row `row` (K-major; col and half multiples of n). Either way the n values
    are 2n contiguous bytes under the 128-byte swizzle (n <= 8): one store each."""
    n = cute.size(x.shape)
    hi = cute.make_rmem_tensor((n,), BFloat16)
    x_hi = x.to(BFloat16)
    hi.store(x_hi)
    _copy_piece(image, row, col, hi, along_rows)
    if cutlass.const_expr(passes == 3):
        lo = cute.make_rmem_tensor((n,), BFloat16)
        lo.store((x - x_hi.to(Float32)).to(BFloat16))
        _copy_piece(image, row, half + col, lo, along_rows)


@cute.jit
def store_piece(image: cute.Tensor, row, col, values, along_rows: cutlass.Constexpr[bool]):
    """n bf16 values (a vector; n = 2, 4 or 8) into an image, placed as put_piece places them:
    one 4-, 8- or 16-byte store (element by element where an image's layout does not keep them
    together)."""
    n = cute.size(values.shape)
    piece = cute.make_rmem_tensor((n,), BFloat16)
    piece.store(values)
    _copy_piece(image, row, col, piece, along_rows)


@cute.jit
def _copy_piece(image: cute.Tensor, row, col, piece: cute.Tensor,
                along_rows: cutlass.Constexpr[bool]):  # fmt: skip
    n = cute.size(piece)
    if cutlass.const_expr(along_rows):
        cute.autovec_copy(piece, cute.local_tile(image, (n, 1), (row // n, col))[None, 0])
    else:
        cute.autovec_copy(piece, cute.local_tile(image, (1, n), (row, col // n))[0, None])


def image_k(k: int, passes: int) -> int:
    """K extent of an operand image of K = k: [hi | lo] for three passes, the value for one."""
    if passes not in (1, 3):
        raise ValueError(f"passes is 1 or 3, not {passes}")
    return 2 * k if passes == 3 else k


@cute.jit
def put_operand(image: cute.Tensor, row, col, half: cutlass.Constexpr[int], x: Float32,
                passes: cutlass.Constexpr[int] = 3):  # fmt: skip
    """x into an operand image: put_split for three passes, bf16 x at (row, col) for one."""
    if cutlass.const_expr(passes == 3):
        put_split(image, row, col, half, x)
    else:
        image[row, col] = x.to(BFloat16)


@cute.jit
def gemm_bf16x3(
    mma: cute.TiledMma,
    acc: cute.Tensor,
    a_hi: cute.Tensor,
    a_lo: cute.Tensor,
    a_lo_at: cutlass.Constexpr[int],
    b: cute.Tensor,
    k_blocks: cutlass.Constexpr[int],
):
    """Issue acc += A_hi B_hi + A_lo B_hi + A_hi B_lo over k_blocks 16-wide K-blocks (no fence,
    commit or wait: the caller's). b holds [hi | lo] halves; A's low part is K-block
    a_lo_at + kb of a_lo (a_lo = a_hi and a_lo_at = k_blocks for a [hi | lo] image, or separate
    register fragments and 0). The ACCUMULATE field is the caller's too."""
    for kb in cutlass.range_constexpr(k_blocks):
        cute.gemm(mma, acc, a_hi[None, None, kb], b[None, None, kb], acc)
        cute.gemm(mma, acc, a_lo[None, None, a_lo_at + kb], b[None, None, kb], acc)
        cute.gemm(mma, acc, a_hi[None, None, kb], b[None, None, k_blocks + kb], acc)


@cute.jit
def gemm_passes(
    mma: cute.TiledMma,
    acc: cute.Tensor,
    f_a: cute.Tensor,
    f_b: cute.Tensor,
    k_blocks: cutlass.Constexpr[int],
    passes: cutlass.Constexpr[int] = 3,
):
    """Issue acc += A B over k_blocks 16-wide K-blocks of two images (no fence, commit or wait:
    the caller's): gemm_bf16x3 on [hi | lo] images for three passes, one bf16 product a K-block
    on images of the values alone (put_operand with passes=1) for one; for two, A exact in
    bf16 (an image of the values alone) against B's [hi | lo] image, A B_hi + A B_lo."""
    if cutlass.const_expr(passes == 3):
        gemm_bf16x3(mma, acc, f_a, f_a, k_blocks, f_b, k_blocks)
    elif cutlass.const_expr(passes == 2):
        for kb in cutlass.range_constexpr(k_blocks):
            cute.gemm(mma, acc, f_a[None, None, kb], f_b[None, None, kb], acc)
            cute.gemm(mma, acc, f_a[None, None, kb], f_b[None, None, k_blocks + kb], acc)
    else:
        for kb in cutlass.range_constexpr(k_blocks):
            cute.gemm(mma, acc, f_a[None, None, kb], f_b[None, None, kb], acc)


@cute.jit
def product_passes(
    mma: cute.TiledMma,
    acc: cute.Tensor,
    f_a: cute.Tensor,
    f_b: cute.Tensor,
    k_blocks: cutlass.Constexpr[int],
    set_accumulate: cutlass.Constexpr[bool] = True,
    passes: cutlass.Constexpr[int] = 3,
):
    """acc = A B^T of two images in shared memory (the caller fenced and synchronised their
    writes), gemm_passes' products; waited for on return. set_accumulate=False where the call
    sits in a branch of one warpgroup: the caller sets the MMA's ACCUMULATE field outside it (a
    field set inside cannot leave the branch)."""
    acc.fill(0.0)
    cute.nvgpu.warpgroup.fence()
    if cutlass.const_expr(set_accumulate):
        mma.set(warpgroup.Field.ACCUMULATE, True)
    gemm_passes(mma, acc, f_a, f_b, k_blocks, passes)
    cute.nvgpu.warpgroup.commit_group()
    cute.nvgpu.warpgroup.wait_group(0)
