"""The backward of the in-chunk decayed products, sm_90a CuTe DSL: xla._decayed_products_bwd on
tensor cores, parallel over (chunk slot, head).

With E_ijd = exp(Gamma_id - Gamma_jd) and the cotangents w = d_kk, d_qk [64, 64] (taken for
j <= i only) of kk_ij = sum_d k_id k_jd E_ijd and qk_ij = sum_d q_id k_jd E_ijd:
  P(w, x)_id = sum_j w_ij x_jd E_ijd,  P^T(w, x)_jd = sum_i w_ij x_id E_ijd
  dq = P(d_qk, k);  dk = P(d_kk, k) + back;  dGamma = k P(d_kk, k) + q P(d_qk, k) - k back,
  back = P^T(d_kk, k) + P^T(d_qk, q).

The decay is split as in the chunk core (chunk64.py): with row i anchored at m(i),
  P(w, x)_i = r_i * sum_p W_ip R_p, r_i = exp(Gamma_i - Gamma_m(i)), R the packed right factors
    x_j exp(Gamma_m - Gamma_j) of the anchors and W the cotangent in the same packing: one
    [64, 128] product over K = 160 for each of d_kk and d_qk;
  back_j = sum over blocks I of exp(Gamma_{m_I} - Gamma_j) * sum_{i in I} (d_kk_ij kl_i +
    d_qk_ij ql_i), kl_i = k_i r_i and ql_i = q_i r_i: four [64, 128] products over K = 32.
Each [64, 128] product is two m64n64 wgmma, one per warpgroup and half of the channels.
Where the chunk's decay forbids middle anchors, the diagonal blocks are taken pair by pair
(thread d = channel d) onto the outputs the products wrote. Products: bf16 hi/lo splits
(three bf16 products, about 2^-16 relative, float32 accumulation).

Inputs: q, k bfloat16, chunked ([slots, H, 64, 128]) or, with DecayedBwdConfig.from_tokens, in
the tokens' rows ([T, H, 128]; cu_seqlens [N + 1] int32 says which a slot holds, the other rows
zero; the chunked variant takes a cu_seqlens it does not read), gamma [slots, H, 64, 128]
float32, d_kk, d_qk [slots, H, 64, 64] float32 or (the tokens' variant as exported: the dense
kernel's) bfloat16. Outputs: dq, dk, dgamma [slots, H, 64, 128]
float32. One CTA of two warpgroups a (slot, head): each issues the products for its half of the
128 channels (m64n64) and finishes them; the element-wise phases split the rows between them.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.warpgroup as warpgroup
from cutlass import BFloat16, Float32, Int32
from cutlass.memory import SmemAllocator

from jax_kda.constants import HEAD_DIM, SCAN_CHUNK
from jax_kda.sm90.kernels.chunk64 import (
    BLOCK,
    BLOCKS,
    PACKED,
    PAIR_ROW,
    ROWS,
    block_offset,
    choose_anchors,
    exp_fast,
    put_right_factors,
)
from jax_kda.sm90.kernels.chunk_io import pair_at
from jax_kda.sm90.kernels.varlen import slot_rows
from jax_kda.sm90.kernels.wgmma import (
    bf16_tiled_mma,
    image_layout,
    load_f32,
    product_passes,
    put_piece,
    row_piece,
    vec4,
    view,
)

WGS = 2  # warpgroups, one per half of the channels in the products
NTHREADS = 128 * WGS
HALF_N = HEAD_DIM // WGS  # channels of a warpgroup's products
GAM_ROW = HEAD_DIM + 8
EIGHT = 8  # channels a thread takes in the vectorised image builds: 16 bytes of bf16
EIGHTHS = HEAD_DIM // EIGHT  # threads across a row's channels; NTHREADS // EIGHTHS = 16 rows
SIDE = 2 * BLOCK  # K of a back product: block I's 16 rows for d_kk, then for d_qk
# The reused operand region (1024-byte aligned): R^T and the packed cotangent for the forward
# products; then a back product's two images; then the pairwise pass's float32 scratch.
RT_BYTES = HEAD_DIM * 2 * PACKED * 2  # R^T image [128, 320] bf16: 80 KiB
W_BYTES = ROWS * 2 * PACKED * 2  # packed cotangent image [64, 320] bf16: 40 KiB
REGION_BYTES = RT_BYTES + W_BYTES
BACK_A_BYTES = ROWS * 2 * SIDE * 2  # [64, 64] bf16: 8 KiB


@dataclasses.dataclass(frozen=True)
class DecayedBwdConfig:
    from_tokens: bool  # q and k in the tokens' rows, else chunked
    qk_scale: float = 1.0  # d_qk = qk_scale * the given cotangent (the scale of Aqk = scale qk)


class DecayedBwdSm90:
    def __init__(self, config: DecayedBwdConfig):
        self.from_tokens = config.from_tokens
        self.qk_scale = float(config.qk_scale)

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
        # B operands (R^T, the back products' [kl | ql]) are written by channel: N-major; each
        # warpgroup takes half of the channels
        mma = bf16_tiled_mma((ROWS, HALF_N), warpgroup.OperandSource.SMEM, b_mn_major=True)
        self.kernel(q, k, cu_seqlens, gamma, d_kk, d_qk, dq, dk, dgamma, mma).launch(
            grid=[n_slots, heads, 1], block=[NTHREADS, 1, 1], stream=stream
        )

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
        slot, h, _ = cute.arch.block_idx()
        shared = _allocate()
        _, s_q, s_k, s_gam, s_dkk, s_dqk, s_flag = shared

        # ---- the chunk into shared memory, 16 bytes a thread a load, every load issued before
        # the first store; the cotangents for j <= i only; the packed cotangent image zeroed
        # (only its block-diagonal entries are written below)
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
                   count, tid, self.qk_scale)  # fmt: skip
        _zero_words(shared[0], RT_BYTES // 4, W_BYTES // 4, tid)
        cute.arch.sync_threads()
        self._products(shared, mma, mDq[slot, h, None, None], mDk[slot, h, None, None],
                       mDgamma[slot, h, None, None], tid)  # fmt: skip

    @cute.jit
    def _products(self, shared, mma: cute.TiledMma, mDq, mDk, mDgamma, tid):
        """dq, dk, dgamma [64, 128] of the chunk in `shared` (_allocate; q, k, Gamma and the
        cotangents in place and visible to all) into mDq, mDk, mDgamma."""
        d = tid % 128
        part = tid // 128
        g8 = EIGHT * (tid % EIGHTHS)  # the first of this thread's 8 channels in the image builds
        s_region, s_q, s_k, s_gam, s_dkk, s_dqk, s_flag = shared
        row_major = cute.make_layout((ROWS, HEAD_DIM), stride=(HEAD_DIM, 1))
        raw = s_region.iterator
        s_rt = view(raw, 0, image_layout(HEAD_DIM, 2 * PACKED, mn_major=True))
        s_w = view(raw, RT_BYTES, image_layout(ROWS, 2 * PACKED))
        s_back_a = view(raw, 0, image_layout(ROWS, 2 * SIDE))
        s_back_b = view(raw, BACK_A_BYTES, image_layout(HEAD_DIM, 2 * SIDE, mn_major=True))
        s_back = cute.make_tensor(cute.recast_ptr(raw, dtype=Float32), row_major)  # pairwise

        pairwise, shift = choose_anchors(s_gam, s_flag, d)

        mma.set(warpgroup.Field.ACCUMULATE, True)
        thr = mma.get_slice(d)
        # (row, channel - HALF_N part) of this warpgroup's accumulators
        c_out = thr.partition_C(cute.make_identity_tensor((ROWS, HALF_N)))
        n0 = part * HALF_N
        f_rt = mma.make_fragment_B(
            thr.partition_B(cute.local_tile(s_rt, (HALF_N, 2 * PACKED), (part, 0)))
        )
        f_w = mma.make_fragment_A(thr.partition_A(s_w))
        # Two accumulators live at a time (a third spilled): acc_sum holds back (the four back
        # products first), then the forward products finish dq, dk and dgamma straight out.
        acc_x = cute.make_rmem_tensor(mma.partition_shape_C((ROWS, HALF_N)), Float32)
        acc_sum = cute.make_rmem_tensor(mma.partition_shape_C((ROWS, HALF_N)), Float32)

        # ---- back: per block I, [d_kk | d_qk](rows of I, j)^T x [kl | ql](rows of I), times
        # exp(Gamma_m - Gamma_j) for the rows j it pairs with
        f_a = mma.make_fragment_A(thr.partition_A(s_back_a))
        f_b = mma.make_fragment_B(
            thr.partition_B(cute.local_tile(s_back_b, (HALF_N, 2 * SIDE), (part, 0)))
        )
        acc_sum.fill(0.0)
        for b in cutlass.range_constexpr(BLOCKS):
            # rows j < 16 (b + 1) only: the rows past them pair with nothing in block b, and the
            # epilogue below drops their outputs whatever the image held there
            # thread (row j, K columns 8 q .. 8 q + 7): column c < 16 takes d_kk[16 b + c, j],
            # c >= 16 d_qk[16 b + c - 16, j]; zero where j pairs with nothing here
            if tid < BLOCK * (b + 1) * SIDE // EIGHT:
                j = tid // (SIDE // EIGHT)
                c8 = EIGHT * (tid % (SIDE // EIGHT))
                w = cute.make_rmem_tensor((EIGHT,), Float32)
                w.fill(0.0)
                if j < BLOCK * b or pairwise == Int32(0):
                    if c8 < BLOCK:
                        for x in cutlass.range_constexpr(EIGHT):
                            w[x] = s_dkk[BLOCK * b + c8 + x, j]
                    else:
                        for x in cutlass.range_constexpr(EIGHT):
                            w[x] = s_dqk[BLOCK * b + c8 - BLOCK + x, j]
                put_piece(s_back_a, j, c8, w.load(), False, SIDE)
            # [kl | ql] of the block's rows: thread (row c, channels 8 g .. 8 g + 7)
            c = tid // EIGHTHS
            i = BLOCK * b + c
            r = exp_fast(
                load_f32(s_gam[i, None], g8, EIGHT)
                - load_f32(s_gam[BLOCK * b + shift, None], g8, EIGHT)
            )
            put_piece(s_back_b, g8, c, load_f32(s_k[i, None], g8, EIGHT) * r, True, SIDE)
            put_piece(s_back_b, g8, BLOCK + c, load_f32(s_q[i, None], g8, EIGHT) * r, True, SIDE)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            product_passes(mma, acc_x, f_a, f_b, SIDE // 16, False)
            for e in cutlass.range_constexpr(cute.size(acc_x)):
                j, ch = c_out[e]
                ch = ch + n0
                if j < BLOCK * b or (j < BLOCK * (b + 1) and pairwise == Int32(0)):
                    s = exp_fast(s_gam[BLOCK * b + shift, ch] - s_gam[j, ch])
                    acc_sum[e] = acc_sum[e] + s * acc_x[e]
            cute.arch.sync_threads()  # the images are free for the next block

        # ---- R^T: the anchors' right factors, packed, transposed (chunk64.py)
        put_right_factors(s_rt, s_k, s_gam, tid, shift, pairwise, True)

        # ---- P(d_kk, k) and P(d_qk, k): the cotangent in the packing of R, times R, times r_i
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
                        for x in cutlass.range_constexpr(EIGHT):
                            w[x] = s_dw[i, j + x]
                    put_piece(s_w, i, block_offset(b) + j, w.load(), False, PACKED)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            product_passes(mma, acc_x, f_w, f_rt, PACKED // 16, False)
            # a thread holds columns ch, ch + 1 at e, e + 1: stored as 8-byte pairs
            out_a = cute.make_rmem_tensor((2,), Float32)
            out_b = cute.make_rmem_tensor((2,), Float32)
            for e in cutlass.range_constexpr(0, cute.size(acc_x), 2):
                i, ch = c_out[e]
                ch = ch + n0
                anchor_row = (i // BLOCK) * BLOCK + shift
                for x in cutlass.range_constexpr(2):
                    f = acc_x[e + x] * exp_fast(s_gam[i, ch + x] - s_gam[anchor_row, ch + x])
                    if cutlass.const_expr(which == 0):  # acc_sum: back, then k (f - back)
                        back = acc_sum[e + x]
                        out_a[x] = f + back
                        acc_sum[e + x] = Float32(s_k[i, ch + x]) * (f - back)
                    else:
                        out_a[x] = f
                        out_b[x] = acc_sum[e + x] + Float32(s_q[i, ch + x]) * f
                if cutlass.const_expr(which == 0):
                    pair_at(mDk[i, None], ch).store(out_a.load())
                else:
                    pair_at(mDq[i, None], ch).store(out_a.load())
                    pair_at(mDgamma[i, None], ch).store(out_b.load())
            cute.arch.sync_threads()  # every wgmma read of the images is done

        # ---- the diagonal blocks pair by pair where the chunk's decay forbids middle anchors:
        # warpgroup 0, thread d = channel d, adds them onto the rows the products wrote
        if pairwise != Int32(0):
            if part == 0:
                for i in cutlass.range(ROWS, unroll=1):
                    s_back[i, d] = Float32(0.0)
            cute.arch.sync_threads()  # the products' global writes are visible to every thread
            if part == 0:
                for i in cutlass.range(ROWS, unroll=1):
                    first = (i // BLOCK) * BLOCK
                    g_i = s_gam[i, d]
                    k_i = Float32(s_k[i, d])
                    q_i = Float32(s_q[i, d])
                    f_kk = Float32(0.0)
                    f_qk = Float32(0.0)
                    for j in cutlass.range(first, i + 1, unroll=1):
                        decay = exp_fast(g_i - s_gam[j, d])
                        t_kk = s_dkk[i, j] * decay
                        t_qk = s_dqk[i, j] * decay
                        k_j = Float32(s_k[j, d])
                        f_kk = f_kk + t_kk * k_j
                        f_qk = f_qk + t_qk * k_j
                        s_back[j, d] = s_back[j, d] + t_kk * k_i + t_qk * q_i
                    mDq[i, d] = mDq[i, d] + f_qk
                    mDk[i, d] = mDk[i, d] + f_kk
                    mDgamma[i, d] = mDgamma[i, d] + k_i * f_kk + q_i * f_qk
                for j in cutlass.range(ROWS, unroll=1):
                    k_j = Float32(s_k[j, d])
                    back = s_back[j, d]
                    mDk[j, d] = mDk[j, d] + back
                    mDgamma[j, d] = mDgamma[j, d] - k_j * back


def _allocate():
    """The kernel's shared memory: (operand region, q, k, Gamma, d_kk, d_qk, flag)."""
    smem = SmemAllocator()
    row_major = cute.make_layout((ROWS, HEAD_DIM), stride=(HEAD_DIM, 1))
    s_region = smem.allocate_tensor(Int32, cute.make_layout(REGION_BYTES // 4), 1024)
    s_q = smem.allocate_tensor(BFloat16, row_major, 16)
    s_k = smem.allocate_tensor(BFloat16, row_major, 16)
    # Gamma's rows padded to GAM_ROW: the products' epilogues read it at accumulator
    # coordinates (8 rows x 4 column pairs a warp), 2-way instead of 8-way bank conflicts
    s_gam = smem.allocate_tensor(
        Float32, cute.make_layout((ROWS, HEAD_DIM), stride=(GAM_ROW, 1)), 16
    )
    pairs = cute.make_layout((ROWS, ROWS), stride=(PAIR_ROW, 1))
    s_dkk = smem.allocate_tensor(Float32, pairs, 16)
    s_dqk = smem.allocate_tensor(Float32, pairs, 16)
    s_flag = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
    return s_region, s_q, s_k, s_gam, s_dkk, s_dqk, s_flag


@cute.jit
def _load_rows(s_q, s_k, s_gam, m_q, m_k, m_gam, m_kk, m_qk, s_dkk, s_dqk, row0, count, tid,
               qk_scale: cutlass.Constexpr[float]):  # fmt: skip
    """The chunk into shared memory: rows i < count of q and k from rows row0 + i of m_q, m_k
    ([rows, 128] bf16; the other rows zero), Gamma from m_gam [64, 128], and d_kk and
    qk_scale * m_qk ([64, 64], float32 or bfloat16, both the same) for j <= i only (zero above
    the diagonal), float32 in shared memory. Every thread issues all of its 16-byte loads
    before its first store."""
    per_bf = 8  # bf16 elements in 16 bytes
    per_f = 4  # float32 elements in 16 bytes
    per_w = 128 // m_kk.element_type.width  # cotangent elements in 16 bytes
    tok_passes = ROWS * HEAD_DIM // (NTHREADS * per_bf)
    gam_passes = ROWS * HEAD_DIM // (NTHREADS * per_f)
    pair_passes = ROWS * ROWS // (NTHREADS * per_w)
    r_q = cute.make_rmem_tensor((tok_passes, per_bf), BFloat16)
    r_k = cute.make_rmem_tensor((tok_passes, per_bf), BFloat16)
    r_gam = cute.make_rmem_tensor((gam_passes, per_f), Float32)
    r_kk = cute.make_rmem_tensor((pair_passes, per_w), m_kk.element_type)
    r_qk = cute.make_rmem_tensor((pair_passes, per_w), m_kk.element_type)
    for p in cutlass.range_constexpr(tok_passes):
        e = (p * NTHREADS + tid) * per_bf
        i = e // HEAD_DIM
        c = e % HEAD_DIM
        r_q[p, None].fill(0.0)
        r_k[p, None].fill(0.0)
        if i < count:
            r_q[p, None].store(row_piece(m_q[row0 + i, None], c, per_bf).load())
            r_k[p, None].store(row_piece(m_k[row0 + i, None], c, per_bf).load())
    for p in cutlass.range_constexpr(gam_passes):
        e = (p * NTHREADS + tid) * per_f
        r_gam[p, None].store(vec4(m_gam[e // HEAD_DIM, None].iterator + e % HEAD_DIM).load())
    for p in cutlass.range_constexpr(pair_passes):
        e = (p * NTHREADS + tid) * per_w
        r_kk[p, None].store(row_piece(m_kk[e // ROWS, None], e % ROWS, per_w).load())
        r_qk[p, None].store(row_piece(m_qk[e // ROWS, None], e % ROWS, per_w).load())
    for p in cutlass.range_constexpr(tok_passes):
        e = (p * NTHREADS + tid) * per_bf
        i = e // HEAD_DIM
        c = e % HEAD_DIM
        row_piece(s_q[i, None], c, per_bf).store(r_q[p, None].load())
        row_piece(s_k[i, None], c, per_bf).store(r_k[p, None].load())
    for p in cutlass.range_constexpr(gam_passes):
        e = (p * NTHREADS + tid) * per_f
        vec4(s_gam[e // HEAD_DIM, None].iterator + e % HEAD_DIM).store(r_gam[p, None].load())
    for p in cutlass.range_constexpr(pair_passes):
        e = (p * NTHREADS + tid) * per_w
        i = e // ROWS
        for x in cutlass.range_constexpr(per_w):
            j = e % ROWS + x
            w_kk = Float32(0.0)
            w_qk = Float32(0.0)
            kk_ij = Float32(r_kk[p, x])  # taken out of the vector before the branch
            qk_ij = Float32(r_qk[p, x])
            if j <= i:
                w_kk = kk_ij
                w_qk = qk_ij
                if cutlass.const_expr(qk_scale != 1.0):
                    w_qk = w_qk * Float32(qk_scale)
            s_dkk[i, j] = w_kk
            s_dqk[i, j] = w_qk


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
