"""The backward of the in-chunk decayed products, sm_90a CuTe DSL: xla._decayed_products_bwd on
tensor cores, parallel over (chunk slot, head, half of the channels).

With E_ijd = exp(Gamma_id - Gamma_jd) and the cotangents w = d_kk, d_qk [64, 64] (taken for
j <= i only) of kk_ij = sum_d k_id k_jd E_ijd and qk_ij = sum_d q_id k_jd E_ijd:
  P(w, x)_id = sum_j w_ij x_jd E_ijd,  P^T(w, x)_jd = sum_i w_ij x_id E_ijd
  dq = P(d_qk, k);  dk = P(d_kk, k) + back;  dGamma = k P(d_kk, k) + q P(d_qk, k) - k back,
  back = P^T(d_kk, k) + P^T(d_qk, q).
Every term is separable over the channels d, so a CTA takes 64 of the 128 and the cotangents
whole. d_qk = qk_scale * d_a for the given d_a: the scale multiplies P(d_a, k) in the epilogue
and q in the back products' ql rows, so the cotangents' images hold the given values.

The decay is split as in the chunk core (chunk64.py): with row i anchored at m(i),
  P(w, x)_i = r_i * sum_p W_ip R_p, r_i = exp(Gamma_i - Gamma_m(i)), R the packed right factors
    x_j exp(Gamma_m - Gamma_j) of the anchors and W the cotangent in the same packing: one
    [64, 64] product over K = 160 for each of d_kk and d_a;
  back_j = sum over blocks I of exp(Gamma_{m_I} - Gamma_j) * sum_{i in I} (d_kk_ij kl_i +
    d_a_ij ql_i), kl_i = k_i r_i and ql_i = qk_scale q_i r_i: four [64, 64] products over K = 32.
Where the chunk's decay forbids middle anchors, the diagonal blocks are taken pair by pair
(thread d = channel d) onto the outputs the products wrote. The factors' images hold bf16 hi/lo
splits; bf16 cotangents (the dense kernel's) are exact in bf16 and their images hold the values,
two bf16 products a product (A B_hi + A B_lo); float32 ones are split too, three products (A_hi
B_hi + A_lo B_hi + A_hi B_lo): about 2^-16 relative either way, float32 accumulation.

Inputs: q, k bfloat16, chunked ([slots, H, 64, 128]) or, with DecayedBwdConfig.from_tokens, in
the tokens' rows ([T, H, 128]; cu_seqlens [N + 1] int32 says which a slot holds, the other rows
zero; the chunked variant takes a cu_seqlens it does not read), gamma [slots, H, 64, 128]
float32, d_kk, d_a [slots, H, 64, 64] float32 or bfloat16 (the tokens' variant as exported: the
dense kernel's). Outputs: dq, dk, dgamma [slots, H, 64, 128] float32. One CTA of one warpgroup
a (slot, head, 64 channels); with bf16 cotangents its shared memory (about 111 KiB) lets two
CTAs share an SM, so one CTA's loads and element-wise phases overlap the other's products.

DecayedTokensBwdSm90 runs the tokens' backward (kda_tokens_bwd_sm90.py's contract and math)
after the products in the same CTA: dq_c, dk_c and dgamma_c of its 64 channels stay in shared
memory (float32 stages in the operand region, once the last product has read it) and leave
only as the tokens' gradients, which saves writing and reading them back (96 KiB a slot and
head) and a launch. It reads g's rows in place of Gamma and sums them as the chunk core does
(_gate_cumsum: its Gamma bit for bit, so the chunk core need not store it for this kernel), and
keeps the gate-floor flags dg's rule needs in registers (g was read twice before); its d_kk
and d_a lie in shared memory as M-major operand images, which the back products take as their
A operands in place; a (slot, head)'s two CTAs are next to each other in launch order (cta).
H100, 2026-12-07 (results/2026-12-07-h100-c-*), the kernel's span at 2048x12x1 / 8192x16x1:
97.0 / 490.1 us before, 93.7 / 478.3 with Gamma summed here, then 91.2 / 455.5 with the
paired launch order or 91.4 / 461.9 with the in-place A operands (each bit for bit the two
kernels' results in its GPU test). Once its first phase's loads are in, a CTA asks L2 for its
rows of the tokens phase's operands (prefetch.py): H100, 2026-12-07 (results/2026-12-07-h100-
f-*), the tokens phase 13.5k -> 10.9k cycles a CTA and the first 12.7k -> 13.1k at 2048x12x1,
the kernel 98.1-99.1 / 456.1-457.1 -> 96.6-96.9 / 447.1-450.9 us at 2048x12x1 / 8192x16x1
(two runs each; the step's every result bit for bit as before).
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.warpgroup as warpgroup
from cutlass import BFloat16, Float32, Int32
from cutlass.memory import SmemAllocator

from jax_kda.constants import GATE_FLOOR, HEAD_DIM, SCAN_CHUNK
from jax_kda.sm90.kernels.chunk64 import (
    BLOCK,
    BLOCKS,
    PACKED,
    ROWS,
    block_offset,
    choose_anchors,
    exp_fast,
    put_right_factors,
)
from jax_kda.sm90.kernels.chunk_io import pair_at
from jax_kda.sm90.kernels.prefetch import prefetch_rows
from jax_kda.sm90.kernels.varlen import slot_rows
from jax_kda.sm90.kernels.wgmma import (
    bf16_tiled_mma,
    image_layout,
    load_f32,
    product_passes,
    put_piece,
    row_piece,
    store_piece,
    vec4,
    view,
)

CH = HEAD_DIM // 2  # channels a CTA
HALVES = HEAD_DIM // CH
NTHREADS = 128  # one warpgroup
GAM_ROW = CH + 4  # Gamma's padded rows (float32): the epilogues' reads 2-way bank conflicts
PAIR_PAD = 16  # bytes of padding a cotangent row in shared memory (rows stay 16-byte aligned)
EIGHT = 8  # values a thread takes in the vectorised image builds: 16 bytes of bf16
SIDE = 2 * BLOCK  # K of a back product: block I's 16 rows for d_kk, then for d_a
# The reused operand region (1024-byte aligned): R^T, then the packed cotangent image (zeroed
# once: only its block-diagonal entries are written); before R^T, the back products' images
# lie where R^T goes (the loop's one block at a time; the fused kernel's four B images at
# once, _batched_back); after the products, the pairwise pass's float32 scratch.
RT_BYTES = CH * 2 * PACKED * 2  # R^T image [64, 320] bf16 (hi | lo): 40 KiB
BACK_B_BYTES = CH * 2 * SIDE * 2  # [kl | ql] image [64, 64] bf16 (hi | lo): 8 KiB
# _batched_back's B images stay inside R^T's bytes: the packed cotangent image after them keeps
# the zeros the load phase wrote
assert BLOCKS * BACK_B_BYTES <= RT_BYTES, "_batched_back"
# The fused kernel's bf16 cotangents d_kk and d_a as M-major operand images [64 j, 64 i]
# (128-byte swizzle: row i of the cotangent is 128 contiguous bytes of j): the back products'
# A operands (rows j, K = i) are their 16-row blocks in place, 2 KiB each
PAIRS_BYTES = ROWS * ROWS * 2
A_BLOCK_BYTES = BLOCK * ROWS * 2
# The fused variant's float32 stages of dq, dk, dgamma [64, 64] (rows padded: the accumulator's
# stores 2-way conflicted), then its per-half sums [2, 2, 64], in the region after the products.
STAGE_ROW = CH + 4
STAGE_BYTES = ROWS * STAGE_ROW * 4
PART_BYTES = 2 * 2 * CH * 4
DECAYED_PHASES = (
    "loads, Gamma's cumsum",
    "back products' images",
    "back products and epilogues",
    "R^T images",
    "P(d_kk) and dk",
    "P(d_a), dq and dgamma",
    "diagonal blocks pair by pair",
    "tokens: loads and element-wise terms",
    "tokens: dg's reverse cumsum and stores",
)
"""The fused kernel's phases (DecayedTokensBwdSm90), in order, each ending where thread 0 of the
CTA reads its cycle counter: what the stamps variant (DecayedTokensBwdStampsSm90) times
(benchmarks/decayed_bwd_phases.py). Stores are timed as issued, not as drained."""
DECAYED_STAMPS = (
    "start",
    *(f"after {phase}" for phase in DECAYED_PHASES),
    "timer at start",
    "timer at end",
)
"""What the stamps variant writes for each CTA (int32): thread 0's 32-bit cycle counter (raw)
at the start and after each phase; then the global timer's low 32 bits (ns) at the CTA's start
and end (kda_chunk_operands_sm90.STAMPS's convention)."""


def split_cotangents(dtype) -> bool:
    """Whether cotangents of this dtype take bf16 hi/lo images (float32) or are exact (bf16)."""
    return dtype.width == 32


def w_bytes(split: bool) -> int:
    """The packed cotangent image [64, 160] bf16, [hi | lo] where split."""
    return ROWS * PACKED * 2 * (2 if split else 1)


assert 3 * STAGE_BYTES + PART_BYTES <= RT_BYTES + w_bytes(False), "stages outgrow the region"


def back_a_bytes(split: bool) -> int:
    """A back product's cotangent image [64, 32] bf16, [hi | lo] where split."""
    return ROWS * SIDE * 2 * (2 if split else 1)


@dataclasses.dataclass(frozen=True)
class DecayedBwdConfig:
    from_tokens: bool  # q and k in the tokens' rows, else chunked
    qk_scale: float = 1.0  # d_qk = qk_scale * the given cotangent (the scale of Aqk = scale qk)


class DecayedBwdSm90:
    def __init__(self, config: DecayedBwdConfig):
        self.from_tokens = config.from_tokens
        self.qk_scale = float(config.qk_scale)
        self.stamps = False  # the fused kernel's diagnostic (DecayedTokensBwdStampsSm90)
        self.batched_back = False  # the fused kernel's back products (_batched_back)

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        cu_seqlens: cute.Tensor,
        gamma: cute.Tensor,
        d_kk: cute.Tensor,
        d_qk: cute.Tensor,
        dq: cute.Tensor,
        dk: cute.Tensor,
        dgamma: cute.Tensor,
        stream: cuda.CUstream,
    ):
        n_slots = gamma.shape[0]
        heads = gamma.shape[1]
        # B operands (R^T, the back products' [kl | ql]) are written by channel: N-major
        mma = bf16_tiled_mma((ROWS, CH), warpgroup.OperandSource.SMEM, b_mn_major=True)
        per_sm = 1 if cutlass.const_expr(split_cotangents(d_kk.element_type)) else 2
        self.kernel(q, k, cu_seqlens, gamma, d_kk, d_qk, dq, dk, dgamma, mma).launch(
            grid=[n_slots, heads, HALVES], block=[NTHREADS, 1, 1], stream=stream,
            min_blocks_per_mp=per_sm, preferred_smem_carveout=100,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mCu: cute.Tensor,
        mGamma: cute.Tensor,
        mDkk: cute.Tensor,
        mDqk: cute.Tensor,
        mDq: cute.Tensor,
        mDk: cute.Tensor,
        mDgamma: cute.Tensor,
        mma: cute.TiledMma,
    ):
        tid, _, _ = cute.arch.thread_idx()
        slot, h, half = cute.arch.block_idx()
        c0 = half * CH
        split = split_cotangents(mDkk.element_type)
        shared = _allocate(mDkk.element_type)
        _, s_q, s_k, s_gam, s_dkk, s_dqk, s_flag = shared

        # ---- the chunk's channels into shared memory, 16 bytes a thread a load, every load
        # issued before the first store; the cotangents whole, for j <= i only; the packed
        # cotangent image zeroed (only its block-diagonal entries are written below)
        if tid == 0:
            s_flag[0] = Int32(0)
        row0 = Int32(0)
        count = Int32(ROWS)
        if cutlass.const_expr(self.from_tokens):
            row0, count = slot_rows(mCu, slot, mQ.shape[0], SCAN_CHUNK)
            m_q, m_k = mQ[None, h, None], mK[None, h, None]
        else:
            m_q, m_k = mQ[slot, h, None, None], mK[slot, h, None, None]
        _load_rows(s_q, s_k, s_gam, m_q, m_k, mGamma[slot, h, None, None],
                   mDkk[slot, h, None, None], mDqk[slot, h, None, None], s_dkk, s_dqk, row0,
                   count, c0, tid)  # fmt: skip
        _zero_words(shared[0], RT_BYTES // 4, w_bytes(split) // 4, tid)
        cute.arch.sync_threads()
        self._products(shared, mma, mDq[slot, h, None, None], mDk[slot, h, None, None],
                       mDgamma[slot, h, None, None], c0, tid)  # fmt: skip

    @cute.jit
    def _back_images(self, shared, s_back_a, s_back_b, b: cutlass.Constexpr[int], pairwise, shift,
                     g8, tid, a_passes: cutlass.Constexpr[int]):  # fmt: skip
        """Block b's two back-product images: the cotangents' columns of its rows, [d_kk |
        d_a](rows of b, j)^T, into s_back_a (rows j, K 32; by put_piece's rule for a_passes),
        and [kl | ql] of its rows into s_back_b (channels, K 32 hi | 32 lo); no fence or
        barrier (the caller's)."""
        s_dkk, s_dqk = shared[4:6]
        # rows j < 16 (b + 1) only: the rows past them pair with nothing in block b, and the
        # epilogue below drops their outputs whatever the image held there
        # task (row j, K columns 8 q .. 8 q + 7): column c < 16 takes d_kk[16 b + c, j],
        # c >= 16 d_a[16 b + c - 16, j]; zero where j pairs with nothing here
        tasks = BLOCK * (b + 1) * SIDE // EIGHT
        for t in cutlass.range_constexpr((tasks + NTHREADS - 1) // NTHREADS):
            task = tid + t * NTHREADS
            if task < tasks:
                j = task // (SIDE // EIGHT)
                c8 = EIGHT * (task % (SIDE // EIGHT))
                w = cute.make_rmem_tensor((EIGHT,), Float32)
                w.fill(0.0)
                if j < BLOCK * b or pairwise == Int32(0):
                    if c8 < BLOCK:
                        for x in cutlass.range_constexpr(EIGHT):
                            w[x] = Float32(s_dkk[BLOCK * b + c8 + x, j])
                    else:
                        for x in cutlass.range_constexpr(EIGHT):
                            w[x] = Float32(s_dqk[BLOCK * b + c8 - BLOCK + x, j])
                put_piece(s_back_a, j, c8, w.load(), False, SIDE, a_passes)
        self._back_b_image(shared, s_back_b, b, shift, g8, tid)

    @cute.jit
    def _back_b_image(self, shared, s_back_b, b: cutlass.Constexpr[int], shift, g8, tid):
        """Block b's B image of the back products: [kl | ql] of its rows into s_back_b
        (channels, K 32 hi | 32 lo); no fence or barrier (the caller's)."""
        s_q, s_k, s_gam = shared[1:4]
        qk_scale = self.qk_scale
        # [kl | ql] of the block's rows: thread (row c, channels g8 .. g8 + 7)
        c = tid // (CH // EIGHT)
        i = BLOCK * b + c
        r = exp_fast(
            load_f32(s_gam[i, None], g8, EIGHT)
            - load_f32(s_gam[BLOCK * b + shift, None], g8, EIGHT)
        )
        ql = load_f32(s_q[i, None], g8, EIGHT) * r
        if cutlass.const_expr(qk_scale != 1.0):
            ql = ql * Float32(qk_scale)
        put_piece(s_back_b, g8, c, load_f32(s_k[i, None], g8, EIGHT) * r, True, SIDE)
        put_piece(s_back_b, g8, BLOCK + c, ql, True, SIDE)

    @cute.jit
    def cta(self):
        """This CTA's (chunk slot, head, half of the channels): the grid's (x, y, z)."""
        return cute.arch.block_idx()

    @cute.jit
    def stamp(self, mStamps, index: cutlass.Constexpr[int], tid):
        """The stamps variant's clock after a phase (thread 0's, raw): DECAYED_STAMPS."""
        if cutlass.const_expr(self.stamps):
            if tid == 0:
                slot, h, half = self.cta()
                mStamps[slot, h, half, index] = cute.arch.clock()

    @cute.jit
    def _products(self, shared, mma: cute.TiledMma, mDq, mDk, mDgamma, c0, tid,
                  staged: cutlass.Constexpr[bool] = False, mStamps=None, mma_back=None,
                  s_pairs=None):  # fmt: skip
        """dq, dk, dgamma [64, 128] of the chunk in `shared` (_allocate; q, k, Gamma of channels
        c0 .. c0 + 63 and the cotangents in place and visible to all) into those channels of
        mDq, mDk, mDgamma; staged: into the float32 stages of the region instead (stages(),
        columns 0 .. 63; mDq, mDk, mDgamma unused), once every product has read its images."""
        s_region, s_q, s_k, s_gam, s_dkk, s_dqk, s_flag = shared
        split = split_cotangents(s_dkk.element_type)
        a_passes = 3 if cutlass.const_expr(split) else 1  # the cotangent images' rule
        passes = 3 if cutlass.const_expr(split) else 2  # the products'
        qk_scale = self.qk_scale
        g8 = EIGHT * (tid % (CH // EIGHT))  # the first of this thread's 8 channels in the builds
        raw = s_region.iterator
        s_rt = view(raw, 0, image_layout(CH, 2 * PACKED, mn_major=True))
        s_w = view(raw, RT_BYTES, image_layout(ROWS, PACKED * (2 if split else 1)))
        s_back_a = view(raw, 0, image_layout(ROWS, SIDE * (2 if split else 1)))
        s_back_b = view(raw, back_a_bytes(split), image_layout(CH, 2 * SIDE, mn_major=True))
        s_back = cute.make_tensor(  # the pairwise pass's
            cute.recast_ptr(raw, dtype=Float32), cute.make_layout((ROWS, CH), stride=(CH, 1))
        )

        pairwise, shift = choose_anchors(s_gam, s_flag, tid % CH)

        mma.set(warpgroup.Field.ACCUMULATE, True)
        thr = mma.get_slice(tid)
        c_out = thr.partition_C(cute.make_identity_tensor((ROWS, CH)))  # (row, channel)
        f_rt = mma.make_fragment_B(thr.partition_B(s_rt))
        f_w = mma.make_fragment_A(thr.partition_A(s_w))
        # Two accumulators live at a time: acc_sum holds back (the four back products first),
        # then the forward products finish dq, dk and dgamma straight out.
        acc_x = cute.make_rmem_tensor(mma.partition_shape_C((ROWS, CH)), Float32)
        acc_sum = cute.make_rmem_tensor(mma.partition_shape_C((ROWS, CH)), Float32)

        # ---- back: per block I, [d_kk | d_a](rows of I, j)^T x [kl | ql](rows of I), times
        # exp(Gamma_m - Gamma_j) for the rows j it pairs with
        f_a = mma.make_fragment_A(thr.partition_A(s_back_a))
        f_b = mma.make_fragment_B(thr.partition_B(s_back_b))
        acc_sum.fill(0.0)
        for b in cutlass.range_constexpr(0 if self.batched_back else BLOCKS):
            self._back_images(shared, s_back_a, s_back_b, b, pairwise, shift, g8, tid, a_passes)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            product_passes(mma, acc_x, f_a, f_b, SIDE // 16, False, passes)
            for e in cutlass.range_constexpr(cute.size(acc_x)):
                j, ch = c_out[e]
                if j < BLOCK * b or (j < BLOCK * (b + 1) and pairwise == Int32(0)):
                    s = exp_fast(s_gam[BLOCK * b + shift, ch] - s_gam[j, ch])
                    acc_sum[e] = acc_sum[e] + s * acc_x[e]
            cute.arch.sync_threads()  # the images are free for the next block
        if cutlass.const_expr(self.batched_back):  # the loop above then runs no block
            self._batched_back(shared, mma_back, s_pairs, c_out, acc_x, acc_sum, pairwise, shift,
                               g8, tid, mStamps)  # fmt: skip
        self.stamp(mStamps, 3, tid)

        # ---- R^T: the anchors' right factors, packed, transposed (chunk64.py)
        put_right_factors(s_rt, s_k, s_gam, tid, shift, pairwise, True, 3, CH)
        self.stamp(mStamps, 4, tid)

        # ---- P(d_kk, k) and P(d_a, k): the cotangent in the packing of R, times R, times r_i
        # (staged: dk waits in registers until the last product has read the region)
        r_dk = cute.make_rmem_tensor(acc_x.shape, Float32)
        s_st_dq, s_st_dk, s_st_dg = stages(s_region)
        # row and column indices the branches below assign (the back loop's, where it ran)
        i = Int32(0)
        j = Int32(0)
        for which in cutlass.range_constexpr(2):
            s_dw = s_dkk if cutlass.const_expr(which == 0) else s_dqk
            # row i pairs only with its own block's packed rows; the rest of the image stays
            # zero from the load phase
            # thread (row i, packed columns j .. j + 7 of its block): a group of 8 lies wholly
            # inside or outside the diagonal block (16 b and j multiples of 8)
            for b in cutlass.range_constexpr(BLOCKS):
                width = BLOCK * (b + 1)
                if tid < width * BLOCK // EIGHT:
                    i = BLOCK * b + tid // (width // EIGHT)
                    j = EIGHT * (tid % (width // EIGHT))
                    w = cute.make_rmem_tensor((EIGHT,), Float32)
                    w.fill(0.0)
                    if j < BLOCK * b or pairwise == Int32(0):
                        if cutlass.const_expr(s_pairs is None):
                            w.store(load_f32(s_dw[i, None], j, EIGHT))
                        else:  # the swizzled images: 16 contiguous bytes all the same
                            piece = cute.make_rmem_tensor((EIGHT,), BFloat16)
                            cute.autovec_copy(_row_piece_of(s_dw, i, j, EIGHT), piece)
                            w.store(piece.load().to(Float32))
                    put_piece(s_w, i, block_offset(b) + j, w.load(), False, PACKED, a_passes)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            product_passes(mma, acc_x, f_w, f_rt, PACKED // 16, False, passes)
            if cutlass.const_expr(staged and which == 1):
                cute.arch.sync_threads()  # every wgmma read of the region is done
                for e in cutlass.range_constexpr(0, cute.size(acc_x), 2):
                    i, ch = c_out[e]
                    for x in cutlass.range_constexpr(2):
                        s_st_dk[i, ch + x] = r_dk[e + x]
            # a thread holds columns ch, ch + 1 at e, e + 1: stored as 8-byte pairs
            out_a = cute.make_rmem_tensor((2,), Float32)
            out_b = cute.make_rmem_tensor((2,), Float32)
            for e in cutlass.range_constexpr(0, cute.size(acc_x), 2):
                i, ch = c_out[e]
                anchor_row = (i // BLOCK) * BLOCK + shift
                for x in cutlass.range_constexpr(2):
                    f = acc_x[e + x] * exp_fast(s_gam[i, ch + x] - s_gam[anchor_row, ch + x])
                    if cutlass.const_expr(which == 0):  # acc_sum: back, then k (f - back)
                        back = acc_sum[e + x]
                        out_a[x] = f + back
                        r_dk[e + x] = f + back
                        acc_sum[e + x] = Float32(s_k[i, ch + x]) * (f - back)
                    else:
                        if cutlass.const_expr(qk_scale != 1.0):
                            f = f * Float32(qk_scale)
                        out_a[x] = f
                        out_b[x] = acc_sum[e + x] + Float32(s_q[i, ch + x]) * f
                if cutlass.const_expr(staged):
                    if cutlass.const_expr(which == 1):
                        for x in cutlass.range_constexpr(2):
                            s_st_dq[i, ch + x] = out_a[x]
                            s_st_dg[i, ch + x] = out_b[x]
                elif cutlass.const_expr(which == 0):
                    pair_at(mDk[i, None], c0 + ch).store(out_a.load())
                else:
                    pair_at(mDq[i, None], c0 + ch).store(out_a.load())
                    pair_at(mDgamma[i, None], c0 + ch).store(out_b.load())
            cute.arch.sync_threads()  # every wgmma read of the images is done
            self.stamp(mStamps, 5 + which, tid)

        # ---- the diagonal blocks pair by pair where the chunk's decay forbids middle anchors:
        # thread d = channel c0 + d adds them onto the rows the products wrote (the global
        # outputs, a pair's back term gathered in s_back first; staged: the stages' column d,
        # which no other thread touches, back and all)
        if pairwise != Int32(0):
            d = tid
            if cutlass.const_expr(not staged):
                if d < CH:
                    for i in cutlass.range(ROWS, unroll=1):
                        s_back[i, d] = Float32(0.0)
                cute.arch.sync_threads()  # the products' global writes are visible to every thread
            o_dq, o_dk, o_dg = (s_st_dq, s_st_dk, s_st_dg) if staged else (mDq, mDk, mDgamma)
            col = d if cutlass.const_expr(staged) else c0 + d
            if d < CH:
                for i in cutlass.range(ROWS, unroll=1):
                    first = (i // BLOCK) * BLOCK
                    g_i = s_gam[i, d]
                    k_i = Float32(s_k[i, d])
                    q_i = Float32(s_q[i, d])
                    f_kk = Float32(0.0)
                    f_qk = Float32(0.0)
                    for j in cutlass.range(first, i + 1, unroll=1):
                        decay = exp_fast(g_i - s_gam[j, d])
                        t_kk = Float32(s_dkk[i, j]) * decay
                        t_qk = Float32(s_dqk[i, j]) * decay
                        if cutlass.const_expr(qk_scale != 1.0):
                            t_qk = t_qk * Float32(qk_scale)
                        k_j = Float32(s_k[j, d])
                        f_kk = f_kk + t_kk * k_j
                        f_qk = f_qk + t_qk * k_j
                        if cutlass.const_expr(staged):
                            back = t_kk * k_i + t_qk * q_i
                            o_dk[j, col] = o_dk[j, col] + back
                            o_dg[j, col] = o_dg[j, col] - k_j * back
                        else:
                            s_back[j, d] = s_back[j, d] + t_kk * k_i + t_qk * q_i
                    o_dq[i, col] = o_dq[i, col] + f_qk
                    o_dk[i, col] = o_dk[i, col] + f_kk
                    o_dg[i, col] = o_dg[i, col] + k_i * f_kk + q_i * f_qk
                if cutlass.const_expr(not staged):
                    for j in cutlass.range(ROWS, unroll=1):
                        k_j = Float32(s_k[j, d])
                        back = s_back[j, d]
                        mDk[j, c0 + d] = mDk[j, c0 + d] + back
                        mDgamma[j, c0 + d] = mDgamma[j, c0 + d] - k_j * back
            if cutlass.const_expr(staged):
                cute.arch.sync_threads()
        self.stamp(mStamps, 7, tid)


class DecayedTokensBwdSm90(DecayedBwdSm90):
    """The decayed products' backward with the tokens' backward (kda_tokens_bwd_sm90.py's
    contract and math) fused after it: the CTA's dq_c, dk_c and dgamma_c [64 rows, 64 channels]
    stay in shared memory, and the element-wise terms, dg's reverse cumsum and dbeta's partial
    sum over the CTA's channels go straight into the tokens' rows. q and k from the tokens'
    rows, the cotangents d_kk and d_a bfloat16 (the dense kernel's), qk_scale = scale; the
    back products batched (_batched_back); Gamma summed from g in the kernel (_gate_cumsum).

    Inputs: q, k, v [T, H, 128] bfloat16, g [T, H, 128] and beta [T, H] float32, cu_seqlens
    [N + 1] int32, d_kk, d_a [slots, H, 64, 64] bfloat16,
    d_rhs [slots, H, 64, 256], d_qg, d_kd [slots, H, 64, 128] bfloat16, d_decay [slots, H, 128]
    and d_beta_kk [slots, H, 64] float32. Outputs: dq, dk, dv [T, H, 128] bfloat16, dg [T, H,
    128] float32, dbeta [2, T, H] float32 (two partial sums, one a half of the channels; the
    first holds d_beta_kk too)."""

    def __init__(self, scale: float, stamps: bool = False):
        super().__init__(DecayedBwdConfig(from_tokens=True, qk_scale=scale))
        self.stamps = stamps
        self.batched_back = True  # _batched_back

    @cute.jit
    def cta(self):
        """This CTA's (chunk slot, head, half of the channels): a (slot, head)'s two CTAs, one
        a half of the channels, are next to each other in launch order (grid [2 slots, H]), so
        that they run at about the same time and d_kk and d_a, which both read whole, come from
        DRAM once between them (L2 serves the second). H100, 2026-12-07, against the grid
        [slots, H, 2] (results/2026-12-07-h100-c-decayed-bwd-phases.log): bit for bit the same
        results, the span 93.7 -> 91.2 us at 2048x12x1 and 478.3 -> 455.5 at 8192x16x1."""
        x, y, _ = cute.arch.block_idx()
        return x // HALVES, y, x % HALVES

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        g: cute.Tensor,
        beta: cute.Tensor,
        cu_seqlens: cute.Tensor,
        d_kk: cute.Tensor,
        d_qk: cute.Tensor,
        d_rhs: cute.Tensor,
        d_qg: cute.Tensor,
        d_kd: cute.Tensor,
        d_decay: cute.Tensor,
        d_beta_kk: cute.Tensor,
        dq: cute.Tensor,
        dk: cute.Tensor,
        dv: cute.Tensor,
        dg: cute.Tensor,
        dbeta: cute.Tensor,
        stream: cuda.CUstream,
    ):
        self.launch(
            q, k, v, g, beta, cu_seqlens, d_kk, d_qk, d_rhs, d_qg, d_kd, d_decay, d_beta_kk,
            dq, dk, dv, dg, dbeta, None, stream,
        )  # fmt: skip

    @cute.jit
    def launch(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        g: cute.Tensor,
        beta: cute.Tensor,
        cu_seqlens: cute.Tensor,
        d_kk: cute.Tensor,
        d_qk: cute.Tensor,
        d_rhs: cute.Tensor,
        d_qg: cute.Tensor,
        d_kd: cute.Tensor,
        d_decay: cute.Tensor,
        d_beta_kk: cute.Tensor,
        dq: cute.Tensor,
        dk: cute.Tensor,
        dv: cute.Tensor,
        dg: cute.Tensor,
        dbeta: cute.Tensor,
        stamps: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        if cutlass.const_expr(split_cotangents(d_kk.element_type)):
            raise TypeError("the fused kernel takes bf16 cotangents (the dense kernel's)")
        mma = bf16_tiled_mma((ROWS, CH), warpgroup.OperandSource.SMEM, b_mn_major=True)
        # the back products: A the cotangents' blocks in place (M-major images)
        mma_back = bf16_tiled_mma(
            (ROWS, CH), warpgroup.OperandSource.SMEM, b_mn_major=True, a_mn_major=True
        )
        self.fused_kernel(
            q, k, v, g, beta, cu_seqlens, d_kk, d_qk, d_rhs, d_qg, d_kd, d_decay, d_beta_kk,
            dq, dk, dv, dg, dbeta, mma, mma_back, stamps,
        ).launch(
            grid=self.grid(d_kk.shape[0], d_kk.shape[1]), block=[NTHREADS, 1, 1],
            stream=stream, min_blocks_per_mp=2, preferred_smem_carveout=100,
        )  # fmt: skip

    def grid(self, n_slots, heads):
        """The launch grid for n_slots chunk slots and `heads` heads (cta's inverse)."""
        return [HALVES * n_slots, heads, 1]

    @cute.kernel
    def fused_kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mCu: cute.Tensor,
        mDkk: cute.Tensor,
        mDqk: cute.Tensor,
        mDrhs: cute.Tensor,
        mDqg: cute.Tensor,
        mDkd: cute.Tensor,
        mDdecay: cute.Tensor,
        mDbetaKk: cute.Tensor,
        mDq: cute.Tensor,
        mDk: cute.Tensor,
        mDv: cute.Tensor,
        mDg: cute.Tensor,
        mDbeta: cute.Tensor,
        mma: cute.TiledMma,
        mma_back: cute.TiledMma,
        mStamps: cute.Tensor | None = None,
    ):
        tid, _, _ = cute.arch.thread_idx()
        slot, h, half = self.cta()
        if cutlass.const_expr(self.stamps):
            if tid == 0:
                mStamps[slot, h, half, len(DECAYED_STAMPS) - 2] = cute.arch.globaltimer_lo()
                mStamps[slot, h, half, 0] = cute.arch.clock()
        c0 = half * CH
        shared, s_pairs = _allocate_images()
        s_region, s_q, s_k, s_gam, s_dkk, s_dqk, s_flag = shared
        if tid == 0:
            s_flag[0] = Int32(0)
        tokens = mQ.shape[0]
        row0, count = slot_rows(mCu, slot, tokens, SCAN_CHUNK)
        # g's rows in place of Gamma (whose in-chunk cumsum follows, as the chunk core sums it)
        _load_rows(s_q, s_k, s_gam, mQ[None, h, None], mK[None, h, None], mG[None, h, None],
                   mDkk[slot, h, None, None], mDqk[slot, h, None, None], s_dkk, s_dqk, row0,
                   count, c0, tid, True, True)  # fmt: skip
        _zero_words(s_region, RT_BYTES // 4, w_bytes(False) // 4, tid)
        cute.arch.sync_threads()
        # the tokens phase's operands into L2 (prefetch.py) while the products run, once the
        # first phase's own loads are in: this chunk's rows of d_rhs, d_qg and d_kd (all 64:
        # the tokens phase reads them whole) and its token rows of v
        bf_row = CH * mDrhs.element_type.width // 8  # bytes of a row's 64 channels
        m_rhs, m_qg, m_kd = (mDrhs[slot, h, None, None], mDqg[slot, h, None, None],
                             mDkd[slot, h, None, None])  # fmt: skip
        prefetch_rows(((m_rhs, c0, bf_row), (m_rhs, HEAD_DIM + c0, bf_row), (m_qg, c0, bf_row),
                       (m_kd, c0, bf_row)), 0, ROWS, tid, NTHREADS)  # fmt: skip
        prefetch_rows(((mV[None, h, None], c0, bf_row),), row0, count, tid, NTHREADS)
        at_floor, above_floor = _gate_cumsum(s_gam, tid)
        self.stamp(mStamps, 1, tid)
        self._products(shared, mma, None, None, None, c0, tid, True, mStamps, mma_back, s_pairs)
        self._tokens(shared, mV, mBeta, mDrhs[slot, h, None, None], mDqg[slot, h, None, None],
                     mDkd[slot, h, None, None], mDdecay[slot, h, None], mDbetaKk[slot, h, None],
                     mDq, mDk, mDv, mDg, mDbeta, h, half, row0, count, at_floor, above_floor,
                     tid, mStamps)  # fmt: skip
        self.stamp(mStamps, 9, tid)
        if cutlass.const_expr(self.stamps):
            if tid == 0:
                mStamps[slot, h, half, len(DECAYED_STAMPS) - 1] = cute.arch.globaltimer_lo()

    @cute.jit
    def _batched_back(self, shared, mma_back, s_pairs, c_out, acc_x, acc_sum, pairwise, shift,
                      g8, tid, mStamps=None):  # fmt: skip
        """_products' back products in the fused kernel (bf16 cotangents only): the A operand
        of block b's product, [d_kk | d_a](rows of b, j)^T, is no image of its own but the
        cotangents' M-major images in place (s_pairs, _allocate_images: rows 16 b .. 16 b +
        15 of each, K 16 + 16); every block's B image ([kl | ql], 8 KiB each from the region's
        start) built at once behind one barrier, then the four products (mma_back, A M-major)
        and their epilogues back to back. The same arithmetic as the loop, element by element
        and in the same order (A_kk B_kl_hi, A_kk B_kl_lo, A_a B_ql_hi, A_a B_ql_lo, as
        product_passes took the image's two K-blocks), for every output row the epilogue keeps:
        the rows it drops (j past the block, or in it where the diagonal blocks go pair by
        pair) are the only ones whose A rows differ from the loop's zeroed image. Before
        (H100, 2026-12-07), the A images built here from scalar transposed reads: bit for bit
        the loop's results, the back products 11.4k cycles a CTA against the loop's 11.9k."""
        s_region, s_gam, s_dkk = shared[0], shared[3], shared[4]
        if cutlass.const_expr(split_cotangents(s_dkk.element_type)):
            raise TypeError("batched_back takes bf16 cotangents (its images and passes are theirs)")
        raw = s_region.iterator
        pairs = s_pairs.iterator
        a_layout = image_layout(ROWS, BLOCK, mn_major=True)
        b_layout = image_layout(CH, 2 * SIDE, mn_major=True)
        for b in cutlass.range_constexpr(BLOCKS):
            self._back_b_image(shared, view(raw, b * BACK_B_BYTES, b_layout), b, shift, g8, tid)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()
        self.stamp(mStamps, 2, tid)
        thr = mma_back.get_slice(tid)
        acc_sum.fill(0.0)
        for b in cutlass.range_constexpr(BLOCKS):
            f_kk = mma_back.make_fragment_A(
                thr.partition_A(view(pairs, b * A_BLOCK_BYTES, a_layout))
            )
            f_a = mma_back.make_fragment_A(
                thr.partition_A(view(pairs, PAIRS_BYTES + b * A_BLOCK_BYTES, a_layout))
            )
            f_b = mma_back.make_fragment_B(thr.partition_B(view(raw, b * BACK_B_BYTES, b_layout)))
            acc_x.fill(0.0)
            cute.nvgpu.warpgroup.fence()
            mma_back.set(warpgroup.Field.ACCUMULATE, True)
            for part, f_part in ((0, f_kk), (1, f_a)):  # K-blocks: kl, ql hi; then their lo
                cute.gemm(mma_back, acc_x, f_part[None, None, 0], f_b[None, None, part], acc_x)
                cute.gemm(mma_back, acc_x, f_part[None, None, 0], f_b[None, None, 2 + part], acc_x)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(0)
            for e in cutlass.range_constexpr(cute.size(acc_x)):
                j, ch = c_out[e]
                if j < BLOCK * b or (j < BLOCK * (b + 1) and pairwise == Int32(0)):
                    s = exp_fast(s_gam[BLOCK * b + shift, ch] - s_gam[j, ch])
                    acc_sum[e] = acc_sum[e] + s * acc_x[e]
        # every product has read its images before R^T (which covers the B images) is written
        cute.arch.sync_threads()

    @cute.jit
    def _tokens(self, shared, mV, mBeta, m_rhs, m_qg, m_kd, m_decay, m_beta_kk, mDq, mDk, mDv,
                mDg, mDbeta, h, half, row0, count, at_floor, above_floor, tid,
                mStamps=None):  # fmt: skip
        """kda_tokens_bwd_sm90's terms for the CTA's 64 channels of the chunk, from the staged
        dq_c, dk_c, dgamma_c (_products(staged=True), visible to all): thread (row i = tid / 8
        + 16 t, channels c8 .. c8 + 7) for the element-wise terms, 16 bytes a load or store,
        every load issued before the arithmetic; then thread (half p of the rows, channel d)
        for dg's reverse cumsum and its gate-floor rule."""
        s_region, s_q, s_k, s_gam = shared[:4]
        s_dqc, s_dkc, s_dgc = stages(s_region)
        s_part = cute.make_tensor(  # per half of the rows: its dGamma and kd dKd sums
            cute.recast_ptr(s_region.iterator + 3 * STAGE_BYTES // 4, dtype=Float32),
            cute.make_layout((2, 2, CH), stride=(2 * CH, CH, 1)),
        )
        scale = self.qk_scale
        c0 = half * CH
        c8 = EIGHT * (tid % (CH // EIGHT))
        tasks = ROWS * CH // (NTHREADS * EIGHT)
        lanes = CH // EIGHT  # threads that share a row
        tokens = mV.shape[0]
        r_rw = cute.make_rmem_tensor((tasks, EIGHT), BFloat16)
        r_ru = cute.make_rmem_tensor((tasks, EIGHT), BFloat16)
        r_qg = cute.make_rmem_tensor((tasks, EIGHT), BFloat16)
        r_kd = cute.make_rmem_tensor((tasks, EIGHT), BFloat16)
        r_v = cute.make_rmem_tensor((tasks, EIGHT), BFloat16)
        r_b = cute.make_rmem_tensor((tasks,), Float32)
        r_v.fill(0.0)
        r_b.fill(0.0)
        for t in cutlass.range_constexpr(tasks):
            i = tid // lanes + (NTHREADS // lanes) * t
            r_rw[t, None].store(row_piece(m_rhs[i, None], c0 + c8, EIGHT).load())
            r_ru[t, None].store(row_piece(m_rhs[i, None], HEAD_DIM + c0 + c8, EIGHT).load())
            r_qg[t, None].store(row_piece(m_qg[i, None], c0 + c8, EIGHT).load())
            r_kd[t, None].store(row_piece(m_kd[i, None], c0 + c8, EIGHT).load())
            if tokens > 0:
                token = cutlass.max(cutlass.min(row0 + i, tokens - 1), 0)
                r_v[t, None].store(row_piece(mV[token, h, None], c0 + c8, EIGHT).load())
                r_b[t] = mBeta[token, h]
        gam_last = load_f32(s_gam[ROWS - 1, None], c8, EIGHT)
        for t in cutlass.range_constexpr(tasks):
            i = tid // lanes + (NTHREADS // lanes) * t
            valid = i < count
            b = r_b[t]
            v8 = r_v[t, None].load().to(Float32)
            if not valid:
                b = Float32(0.0)
                v8 = v8 * Float32(0.0)
            gam = load_f32(s_gam[i, None], c8, EIGHT)
            e = exp_fast(gam)
            f = exp_fast(gam_last - gam)
            k8 = load_f32(s_k[i, None], c8, EIGHT)
            q8 = load_f32(s_q[i, None], c8, EIGHT)
            d_rw = r_rw[t, None].load().to(Float32)
            d_ru = r_ru[t, None].load().to(Float32)
            d_qg = r_qg[t, None].load().to(Float32)
            d_kd = r_kd[t, None].load().to(Float32)
            dq = load_f32(s_dqc[i, None], c8, EIGHT) + scale * e * d_qg
            dk = load_f32(s_dkc[i, None], c8, EIGHT) + b * e * d_rw + f * d_kd
            kd_term = k8 * f * d_kd
            d_gam = (
                load_f32(s_dgc[i, None], c8, EIGHT)
                + b * k8 * e * d_rw
                + scale * q8 * e * d_qg
                - kd_term
            )
            term = d_rw * k8 * e + d_ru * v8
            row_sum = Float32(0.0)
            for x in cutlass.range_constexpr(EIGHT):
                row_sum = row_sum + term[x]
            for offset in cutlass.range_constexpr(3):  # over the row's 8 threads
                row_sum = row_sum + cute.arch.shuffle_sync_bfly(row_sum, offset=4 >> offset)
            # the stages take dGamma (in place of dgamma_c) and kd dKd (of dq_c): each element
            # is this thread's alone
            piece = cute.make_rmem_tensor((EIGHT,), Float32)
            piece.store(d_gam)
            cute.autovec_copy(piece, cute.make_tensor(
                (s_dgc[i, None].iterator + c8).align(16), cute.make_layout(EIGHT)))  # fmt: skip
            piece.store(kd_term)
            cute.autovec_copy(piece, cute.make_tensor(
                (s_dqc[i, None].iterator + c8).align(16), cute.make_layout(EIGHT)))  # fmt: skip
            if valid:
                token = row0 + i
                row_piece(mDq[token, h, None], c0 + c8, EIGHT).store(dq.to(BFloat16))
                row_piece(mDk[token, h, None], c0 + c8, EIGHT).store(dk.to(BFloat16))
                row_piece(mDv[token, h, None], c0 + c8, EIGHT).store((b * d_ru).to(BFloat16))
                if c8 == 0:
                    total = row_sum
                    if half == 0:
                        total = total + m_beta_kk[i]
                    mDbeta[half, token, h] = total
        cute.arch.sync_threads()
        self.stamp(mStamps, 8, tid)

        # dg: thread (p, d) = channel d over rows [32 p, 32 p + 32): the reverse cumsum within
        # its rows, then the later half's sum and the last row's terms (every row's kd dKd and
        # the chunk decay's a dA) onto every row; then through the gate floor (the flags
        # _gate_cumsum took for this thread's rows)
        d = tid % CH
        p = tid // CH
        span = ROWS // 2
        run = Float32(0.0)
        kd_sum = Float32(0.0)
        for r in cutlass.range_constexpr(span):
            i = p * span + span - 1 - r
            run = run + s_dgc[i, d]
            s_dgc[i, d] = run
            kd_sum = kd_sum + s_dqc[i, d]
        s_part[p, 0, d] = run
        s_part[p, 1, d] = kd_sum
        cute.arch.sync_threads()
        last = exp_fast(s_gam[ROWS - 1, d]) * m_decay[c0 + d] + s_part[0, 1, d] + s_part[1, 1, d]
        if p == 0:
            last = last + s_part[1, 0, d]
        for r in cutlass.range_constexpr(span):
            i = p * span + r
            if i < count:
                total_dg = s_dgc[i, d] + last
                floored = Float32(0.0)
                if (at_floor >> r) & Int32(1) != Int32(0):
                    floored = Float32(0.5) * total_dg
                if (above_floor >> r) & Int32(1) != Int32(0):
                    floored = total_dg
                mDg[row0 + i, h, c0 + d] = floored


def stages(s_region: cute.Tensor):
    """The fused variant's float32 [64, 64] stages of dq, dk, dgamma (the products' results for
    the CTA's channels) in the region, once the products are done with it."""
    return tuple(
        cute.make_tensor(
            cute.recast_ptr(s_region.iterator + n * STAGE_BYTES // 4, dtype=Float32),
            cute.make_layout((ROWS, CH), stride=(STAGE_ROW, 1)),
        )
        for n in range(3)
    )


def _allocate_rows(smem: SmemAllocator, split: bool):
    """The first of both kernels' shared memory: (operand region, q, k, Gamma), q, k and Gamma
    of the CTA's 64 channels, the region sized for cotangent images split or not."""
    rows = cute.make_layout((ROWS, CH), stride=(CH, 1))
    s_region = smem.allocate_tensor(Int32, cute.make_layout((RT_BYTES + w_bytes(split)) // 4), 1024)
    s_q = smem.allocate_tensor(BFloat16, rows, 16)
    s_k = smem.allocate_tensor(BFloat16, rows, 16)
    s_gam = smem.allocate_tensor(Float32, cute.make_layout((ROWS, CH), stride=(GAM_ROW, 1)), 16)
    return s_region, s_q, s_k, s_gam


def _allocate(cotangent: cutlass.Constexpr):
    """The kernel's shared memory for cotangents of dtype `cotangent`: (operand region, q, k,
    Gamma, d_kk, d_a, flag) (_allocate_rows, then the cotangents in padded rows)."""
    smem = SmemAllocator()
    s_region, s_q, s_k, s_gam = _allocate_rows(smem, split_cotangents(cotangent))
    pair_row = ROWS + PAIR_PAD * 8 // cotangent.width
    pairs = cute.make_layout((ROWS, ROWS), stride=(pair_row, 1))
    s_dkk = smem.allocate_tensor(cotangent, pairs, 16)
    s_dqk = smem.allocate_tensor(cotangent, pairs, 16)
    s_flag = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
    return s_region, s_q, s_k, s_gam, s_dkk, s_dqk, s_flag


def _allocate_images():
    """The fused kernel's shared memory: _allocate's for bf16 cotangents, with d_kk and d_a as
    M-major operand images (PAIRS_BYTES each, one after the other, 1024-byte aligned), viewed
    (i, j) as the other kernels' plain arrays are; and those images' raw words (Int32), which
    the back products take their A operands from."""
    smem = SmemAllocator()
    s_region, s_q, s_k, s_gam = _allocate_rows(smem, False)
    s_pairs = smem.allocate_tensor(Int32, cute.make_layout(2 * PAIRS_BYTES // 4), 1024)
    image = image_layout(ROWS, ROWS, mn_major=True)  # (j, i)
    s_dkk, s_dqk = (_transposed(view(s_pairs.iterator, at, image)) for at in (0, PAIRS_BYTES))
    s_flag = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
    return (s_region, s_q, s_k, s_gam, s_dkk, s_dqk, s_flag), s_pairs


def _transposed(t: cute.Tensor) -> cute.Tensor:
    """t with its two modes swapped (the same elements, coordinates (b, a) for (a, b))."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0]))


def _row_piece_of(s_pairs_view: cute.Tensor, i, j, n: int) -> cute.Tensor:
    """Elements j .. j + n - 1 of row i of a cotangent's (i, j) image view (j a multiple of
    n <= 8): contiguous under the swizzle, one vector access."""
    return cute.local_tile(s_pairs_view, (1, n), (i, j // n))[0, None]


@cute.jit
def _load_rows(s_q, s_k, s_gam, m_q, m_k, m_gam, m_kk, m_qk, s_dkk, s_dqk, row0, count, c0,
               tid, gates: cutlass.Constexpr[bool] = False,
               images: cutlass.Constexpr[bool] = False):  # fmt: skip
    """The chunk into shared memory: channels c0 .. c0 + 63 of rows i < count of q and k from
    rows row0 + i of m_q, m_k ([rows, 128] bf16; the other rows zero) and of Gamma from m_gam
    [64, 128] (gates: of g as given, from rows row0 + i of m_gam [rows, 128] float32, the
    other rows zero, for _gate_cumsum); d_kk and d_a ([64, 64], float32 or bfloat16, both the
    same) whole, in their dtype, for j <= i only (zero above the diagonal; images: s_dkk and
    s_dqk are _allocate_images' swizzled views). Every thread issues all of its 16-byte loads
    before its first store."""
    per_bf = 8  # bf16 elements in 16 bytes
    per_f = 4  # float32 elements in 16 bytes
    per_w = 128 // m_kk.element_type.width  # cotangent elements in 16 bytes
    tok_passes = ROWS * CH // (NTHREADS * per_bf)
    gam_passes = ROWS * CH // (NTHREADS * per_f)
    pair_passes = ROWS * ROWS // (NTHREADS * per_w)
    r_q = cute.make_rmem_tensor((tok_passes, per_bf), BFloat16)
    r_k = cute.make_rmem_tensor((tok_passes, per_bf), BFloat16)
    r_gam = cute.make_rmem_tensor((gam_passes, per_f), Float32)
    r_kk = cute.make_rmem_tensor((pair_passes, per_w), m_kk.element_type)
    r_qk = cute.make_rmem_tensor((pair_passes, per_w), m_kk.element_type)
    for p in cutlass.range_constexpr(tok_passes):
        e = (p * NTHREADS + tid) * per_bf
        i = e // CH
        c = e % CH
        r_q[p, None].fill(0.0)
        r_k[p, None].fill(0.0)
        if i < count:
            r_q[p, None].store(row_piece(m_q[row0 + i, None], c0 + c, per_bf).load())
            r_k[p, None].store(row_piece(m_k[row0 + i, None], c0 + c, per_bf).load())
    for p in cutlass.range_constexpr(gam_passes):
        e = (p * NTHREADS + tid) * per_f
        if cutlass.const_expr(gates):
            r_gam[p, None].fill(0.0)
            if e // CH < count:
                r_gam[p, None].store(
                    vec4(m_gam[row0 + e // CH, None].iterator + c0 + e % CH).load()
                )
        else:
            r_gam[p, None].store(vec4(m_gam[e // CH, None].iterator + c0 + e % CH).load())
    for p in cutlass.range_constexpr(pair_passes):
        e = (p * NTHREADS + tid) * per_w
        r_kk[p, None].store(row_piece(m_kk[e // ROWS, None], e % ROWS, per_w).load())
        r_qk[p, None].store(row_piece(m_qk[e // ROWS, None], e % ROWS, per_w).load())
    for p in cutlass.range_constexpr(tok_passes):
        e = (p * NTHREADS + tid) * per_bf
        row_piece(s_q[e // CH, None], e % CH, per_bf).store(r_q[p, None].load())
        row_piece(s_k[e // CH, None], e % CH, per_bf).store(r_k[p, None].load())
    for p in cutlass.range_constexpr(gam_passes):
        e = (p * NTHREADS + tid) * per_f
        vec4(s_gam[e // CH, None].iterator + e % CH).store(r_gam[p, None].load())
    for p in cutlass.range_constexpr(pair_passes):
        e = (p * NTHREADS + tid) * per_w
        i = e // ROWS
        w_kk = cute.make_rmem_tensor((per_w,), m_kk.element_type)
        w_qk = cute.make_rmem_tensor((per_w,), m_kk.element_type)
        w_kk.fill(0.0)
        w_qk.fill(0.0)
        for x in cutlass.range_constexpr(per_w):
            if e % ROWS + x <= i:
                w_kk[x] = r_kk[p, x]
                w_qk[x] = r_qk[p, x]
        if cutlass.const_expr(images):
            store_piece(s_dkk, i, e % ROWS, w_kk.load(), False)
            store_piece(s_dqk, i, e % ROWS, w_qk.load(), False)
        else:
            row_piece(s_dkk[i, None], e % ROWS, per_w).store(w_kk.load())
            row_piece(s_dqk[i, None], e % ROWS, per_w).store(w_qk.load())


@cute.jit
def _gate_cumsum(s_gam, tid):
    """Gamma = the in-chunk cumsum of g, in place in s_gam (which holds g's rows as given, the
    rows past the chunk's end zero): gates below constants.GATE_FLOOR taken as it (NaN stays
    NaN), and each channel summed as the chunk core sums it (kda_chunk_operands_sm90: thread
    (p, d) over rows [32 p, 32 p + 32) from zero, then the first half's total added onto the
    second half's rows), so that Gamma is the chunk core's bit for bit. Returns thread (p,
    d)'s gate-floor flags, bit r for row 32 p + r: (g == the floor, g > the floor), which dg's
    rule takes. Barriers inside; s_gam visible to all on return."""
    d = tid % CH
    p = tid // CH
    span = ROWS // 2
    r_run = cute.make_rmem_tensor((span,), Float32)
    for r in cutlass.range_constexpr(span):
        r_run[r] = s_gam[p * span + r, d]
    at_floor = Int32(0)
    above_floor = Int32(0)
    gam = Float32(0.0)
    for r in cutlass.range_constexpr(span):
        gv = r_run[r]
        bit = Int32(1) << r
        if gv == Float32(GATE_FLOOR):
            at_floor = at_floor | bit
        if gv > Float32(GATE_FLOOR):
            above_floor = above_floor | bit
        if gv < Float32(GATE_FLOOR):
            gv = Float32(GATE_FLOOR)
        gam = gam + gv
        s_gam[p * span + r, d] = gam
    cute.arch.sync_threads()
    g_before = Float32(0.0) + s_gam[span - 1, d]  # the chunk core's sum, from zero
    cute.arch.sync_threads()
    if p > 0:
        for r in cutlass.range_constexpr(span):
            s_gam[p * span + r, d] = s_gam[p * span + r, d] + g_before
    cute.arch.sync_threads()
    return at_floor, above_floor


@cute.jit
def _zero_words(s_region: cute.Tensor, first: cutlass.Constexpr[int],
                words: cutlass.Constexpr[int], tid):  # fmt: skip
    """Zero Int32 words [first, first + words) of s_region (first a multiple of 4), 16 bytes a
    thread a store: zero whatever the swizzle of the image that lives there."""
    zeros = cute.make_rmem_tensor((4,), Int32)
    zeros.fill(0)
    for p in cutlass.range_constexpr(words // (NTHREADS * 4)):
        e = first + (p * NTHREADS + tid) * 4
        vec4(s_region.iterator + e).store(zeros.load())


class DecayedTokensBwdStampsSm90(DecayedTokensBwdSm90):
    """The fused kernel's stamps variant (a diagnostic): one more result after dbeta, stamps
    int32 [slots, H, 2, len(DECAYED_STAMPS)], each (slot, head, half) CTA's clocks."""

    def __init__(self, scale: float):
        super().__init__(scale, stamps=True)

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        g: cute.Tensor,
        beta: cute.Tensor,
        cu_seqlens: cute.Tensor,
        d_kk: cute.Tensor,
        d_qk: cute.Tensor,
        d_rhs: cute.Tensor,
        d_qg: cute.Tensor,
        d_kd: cute.Tensor,
        d_decay: cute.Tensor,
        d_beta_kk: cute.Tensor,
        dq: cute.Tensor,
        dk: cute.Tensor,
        dv: cute.Tensor,
        dg: cute.Tensor,
        dbeta: cute.Tensor,
        stamps: cute.Tensor,
        stream: cuda.CUstream,
    ):
        self.launch(
            q, k, v, g, beta, cu_seqlens, d_kk, d_qk, d_rhs, d_qg, d_kd, d_decay, d_beta_kk,
            dq, dk, dv, dg, dbeta, stamps, stream,
        )  # fmt: skip
