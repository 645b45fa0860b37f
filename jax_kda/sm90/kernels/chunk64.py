"""The exact 64-token chunk math the kernels share: how the in-chunk decay exp(Gamma_i - Gamma_j)
(i >= j, Gamma the in-chunk cumsum of g) is split into two factors that cannot overflow.

Rows come in four 16-row blocks. Row i of block I is anchored at one row m_I of its block:
exp(Gamma_i - Gamma_j) = exp(Gamma_i - Gamma_{m_I}) * exp(Gamma_{m_I} - Gamma_j), per channel.
  - Middle anchors (m_I = 16 I + 8) where the decay over each half of every block stays under
    SAFE_RANGE in every channel (gates >= -7.5 always do): every factor of every pair j <= i is
    below exp(SAFE_RANGE), the diagonal blocks included, so every pair is one product.
  - Otherwise first-row anchors (m_I = 16 I): for j in an earlier block both factors are <= 1
    for any g <= 0, and the diagonal blocks are taken pair by pair (exp(Gamma_i - Gamma_j) <= 1).
The choice is uniform per chunk (one CTA).

The right factors of all anchors sit in one packed operand: block I's anchor with the rows
j < 16 (I + 1) it pairs with, at packed rows block_offset(I) + j: 16 + 32 + 48 + 64 = 160.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from jax_kda.constants import HEAD_DIM, SCAN_CHUNK
from jax_kda.sm90.kernels.wgmma import load_f32, put_piece

ROWS = SCAN_CHUNK  # 64 tokens a chunk
BLOCK = 16  # rows of a block: one anchor each
BLOCKS = ROWS // BLOCK
MIDDLE = BLOCK // 2  # the anchor's row within its block, where the decay allows it
PACKED = BLOCK * BLOCKS * (BLOCKS + 1) // 2  # 160 packed right-factor rows
PAIR_ROW = ROWS + 1  # padded rows of float32 [64, 64] pair matrices in shared memory
SAFE_RANGE = 60.0
"""The most decay (in e-folds) either factor may carry: exp(60) = 1.1e26, far inside float32 and
bfloat16's range, whatever the product's other operand."""
LOG2E = 1.4426950408889634
FACTOR_LANES = 8  # channels a thread takes in put_right_factors: 16 bytes of bf16


def exp_fast(x):
    """exp(x) as ex2.approx.ftz(x log2 e) (a float32 scalar or vector): a multiply and one
    MUFU.EX2 against libdevice's expf's range reduction (about ten instructions). Positive
    arguments are at most SAFE_RANGE (choose_anchors), where the relative error is below about
    8e-6 (CUDA's stated bound for __expf, 2 + floor(1.173 |x|) ulp, at |x| = 60; about 4e-6 by
    the rounding of x log2 e and ex2's 2^-22), so a product of two factors stays near the
    three-pass products' 2^-16. Negative arguments (down to the chunk's whole decay) lose
    nothing that matters: results below 2^-126 flush to 0 where expf gave subnormals."""
    return cute.math.exp2(x * Float32(LOG2E), fastmath=True)


def block_offset(block):
    """First packed row of `block`'s anchor: 16 * I (I + 1) / 2."""
    return BLOCK * block * (block + 1) // 2


@cute.jit
def packed_row(p):
    """Packed row p -> (block I, row j): blocks start at 0, 16, 48, 96."""
    b = Int32(0)
    if p >= block_offset(1):
        b = Int32(1)
    if p >= block_offset(2):
        b = Int32(2)
    if p >= block_offset(3):
        b = Int32(3)
    return b, p - BLOCK * b * (b + 1) // 2


@cute.jit
def choose_anchors(s_gam: cute.Tensor, s_flag: cute.Tensor, d):
    """Whether this chunk's blocks may be anchored at their middle rows, from Gamma in shared
    memory ([64, 128] float32, channel d this thread's; all threads call it). s_flag[0] must be
    0 and visible to all before the call. Returns (pairwise, shift): pairwise nonzero means
    first-row anchors with the diagonal blocks pair by pair; shift is the anchor's row in its
    block. Synchronises the CTA."""
    unsafe = Int32(0)
    for b in cutlass.range_constexpr(BLOCKS):
        first = s_gam[BLOCK * b, d]
        middle = s_gam[BLOCK * b + MIDDLE, d]
        last = s_gam[BLOCK * b + BLOCK - 1, d]
        if first - middle > Float32(SAFE_RANGE) or middle - last > Float32(SAFE_RANGE):
            unsafe = Int32(1)
    if unsafe != Int32(0):
        s_flag[0] = Int32(1)
    cute.arch.sync_threads()
    pairwise = s_flag[0]
    shift = Int32(MIDDLE)
    if pairwise != Int32(0):
        shift = Int32(0)
    return pairwise, shift


@cute.jit
def diagonal_inverses(s_kk, s_beta, s_tinv, tid, nthreads: cutlass.Constexpr[int]):
    """The first half of T^-1 (T = I + strictLower(beta_i kk_ij), [64, 64] float32 into s_tinv,
    all of it written): the identity, then the four diagonal blocks' inverses by forward
    substitution (thread = one column of one block, the column in registers), from kk's
    strictly lower part in s_kk (nothing above the diagonal is read) and beta in s_beta.
    below_diagonal_blocks then finishes it. All nthreads threads of the CTA call both (128 or
    256); each synchronises the CTA."""
    for it in cutlass.range_constexpr(ROWS * ROWS // nthreads):
        e = tid + it * nthreads
        i = e // ROWS
        j = e % ROWS
        s_tinv[i, j] = Float32(1.0) if i == j else Float32(0.0)
    cute.arch.sync_threads()
    if tid < ROWS:
        base = (tid // BLOCK) * BLOCK
        lc = tid % BLOCK  # this thread's column within its diagonal block
        x = cute.make_rmem_tensor((BLOCK,), Float32)
        for mm in cutlass.range_constexpr(BLOCK):
            x[mm] = Float32(1.0) if mm == lc else Float32(0.0)
        for rr in cutlass.range_constexpr(1, BLOCK):
            acc = Float32(0.0)
            for mm in cutlass.range_constexpr(rr):  # x is zero above the column: no bound
                acc = acc + s_kk[base + rr, base + mm] * x[mm]
            if rr > lc:
                x[rr] = -s_beta[base + rr] * acc
        for rr in cutlass.range_constexpr(BLOCK):
            s_tinv[base + rr, tid] = x[rr]
    cute.arch.sync_threads()


@cute.jit
def below_diagonal_blocks(s_kk, s_beta, s_tinv, s_m, tid, nthreads: cutlass.Constexpr[int]):
    """The second half of T^-1, after diagonal_inverses: the blocks below the diagonal by block
    substitution by their distance from it, T^-1_(b, c) = -T^-1_(b, b) sum over m in blocks
    c .. b - 1 of L_(b, m) T^-1_(m, c); s_m is [3, 16, 16] float32 scratch. Every loop has a
    static trip count (zeros of T^-1 stand in for the triangle's bounds), so the shared memory
    loads of a sum are issued together."""
    per_pair = BLOCK * BLOCK // nthreads if nthreads < BLOCK * BLOCK else 1
    for dist in cutlass.range_constexpr(1, BLOCKS):
        for pair in cutlass.range_constexpr(BLOCKS - dist):  # block column; its row pair + dist
            for half in cutlass.range_constexpr(per_pair):
                e = tid + half * nthreads
                if e < BLOCK * BLOCK:
                    r = e // BLOCK
                    s = e % BLOCK
                    row = BLOCK * (pair + dist) + r
                    acc = Float32(0.0)
                    for m in cutlass.range_constexpr(BLOCK * pair, BLOCK * (pair + dist)):
                        acc = acc + s_kk[row, m] * s_tinv[m, BLOCK * pair + s]
                    s_m[pair, r, s] = s_beta[row] * acc
        cute.arch.sync_threads()
        for pair in cutlass.range_constexpr(BLOCKS - dist):
            for half in cutlass.range_constexpr(per_pair):
                e = tid + half * nthreads
                if e < BLOCK * BLOCK:
                    r = e // BLOCK
                    s = e % BLOCK
                    diag = BLOCK * (pair + dist)
                    acc = Float32(0.0)
                    for m in cutlass.range_constexpr(BLOCK):  # zero above the diagonal: no bound
                        acc = acc - s_tinv[diag + r, diag + m] * s_m[pair, m, s]
                    s_tinv[diag + r, BLOCK * pair + s] = acc
        cute.arch.sync_threads()


@cute.jit
def put_right_factors(
    image: cute.Tensor,
    s_k: cute.Tensor,
    s_gam: cute.Tensor,
    tid,
    shift,
    pairwise,
    transposed: cutlass.Constexpr[bool],
    passes: cutlass.Constexpr[int] = 3,
    channels: cutlass.Constexpr[int] = HEAD_DIM,
):
    """The packed right factors k_j exp(Gamma_{m_I} - Gamma_j), block I's anchor with the rows
    j < 16 (I + 1), into an operand image (wgmma.put_operand's rule for `passes`): at (packed
    row, channel) with K = the channels, or transposed at (channel, packed row) with K = the
    packed rows (an N-major image). s_k [64, channels] bf16 and s_gam
    [64, channels] float32 in shared memory with 16-byte-aligned rows. For a CTA of 2 channels
    threads (256 for 128 channels; all call it): thread tid takes channels 8 (tid mod
    channels / 8) .. + 7 of the rows j = tid / (channels / 8) + 16 m, 16-byte loads and stores.
    With first-row anchors (pairwise) the diagonal blocks' entries are zero: the pairwise pass
    takes them (their factors could overflow; the exponent is zeroed first, so no inf * 0)."""
    c8 = FACTOR_LANES * (tid % (channels // FACTOR_LANES))
    r = tid // (channels // FACTOR_LANES)
    for b in cutlass.range_constexpr(BLOCKS):
        anchor = load_f32(s_gam[BLOCK * b + shift, None], c8, FACTOR_LANES)
        for m in cutlass.range_constexpr(b + 1):
            j = r + BLOCK * m
            keep = Float32(1.0)
            if cutlass.const_expr(m == b):
                if pairwise != Int32(0):
                    keep = Float32(0.0)
            arg = (anchor - load_f32(s_gam[j, None], c8, FACTOR_LANES)) * keep
            x = load_f32(s_k[j, None], c8, FACTOR_LANES) * exp_fast(arg) * keep
            if cutlass.const_expr(transposed):
                put_piece(image, c8, block_offset(b) + j, x, True, PACKED, passes)
            else:
                put_piece(image, block_offset(b) + j, c8, x, False, channels, passes)
