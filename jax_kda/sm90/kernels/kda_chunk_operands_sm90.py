"""The exact 64-token chunk core on tensor cores, sm_90a CuTe DSL: every chunk's state-independent
operands, parallel over (chunk slot, head). What xla._chunk_operands computes, read straight from
the packed tokens, plus two of its backward's residuals.

Per slot (64 rows; rows past the sequence's end and gap slots read as q = k = v = g = beta = 0),
with Gamma the in-chunk cumsum of g (gates below constants.GATE_FLOOR taken as it, as in xla.py):
  kk_ij = sum_d k_id k_jd exp(Gamma_id - Gamma_jd), qk_ij alike with q_i, for j <= i
  Aqk = scale * qk (j <= i), L = strictLower(beta_i kk_ij)
  [W | U] = (I + L)^-1 [beta k exp(Gamma) | beta v]
  Qg = scale q exp(Gamma), Kd = k exp(Gamma_last - Gamma), a = exp(Gamma_last)

The decay split (chunk64.py): rows anchored at their block's middle row wherever the decay
allows (every pair j <= i one product), else at its first row with the diagonal blocks taken
pair by pair; no factor can overflow, whatever the gate.

The products, on one warpgroup's wgmma with bfloat16 hi/lo splits (hi*hi + lo*hi + hi*lo, about
2^-16 relative, float32 accumulation):
  [kk | qk] rows: left [64, 128] (k or q, anchored) x right^T, right packing each block's anchor
    with the rows j it pairs with: 16 + 32 + 48 + 64 = 160 columns (m64n160, K = 128).
  [W | U] = T^-1 R: T^-1 [64, 64] (float32 by 16-row blocks: the diagonal blocks' inverses by
    forward substitution, then the blocks below by block substitution) x R [64, 256] (m64n256,
    K = 64).

One CTA of two warpgroups a (slot, head): thread (part, d) = channel d of half the rows for the
loads, the cumsum, the operand images and the outputs (one warpgroup alone left the SM's
schedulers a warp each: latency-bound, 78 us a chunk on the H200); warpgroup 0 issues the wgmma.
Outputs, float32: w, u, qg, kd, gamma [slots, H, 64, 128]; attn, kk [slots, H, 64, 64] (zero
above the diagonal); decay [slots, H, 128]; tinv = T^-1 [slots, H, 64, 64] (the backward's
solve T^-T d[W | U] is then one product).
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
    PAIR_ROW,
    ROWS,
    choose_anchors,
    packed_row,
    put_right_factors,
    unit_lower_inverse,
)
from jax_kda.sm90.kernels.varlen import slot_owner
from jax_kda.sm90.kernels.wgmma import (
    bf16_tiled_mma,
    image_k,
    image_layout,
    product_passes,
    put_operand,
    view,
)

WGS = 2  # warpgroups: the element-wise phases split the rows between them
NTHREADS = 128 * WGS
WARPS = NTHREADS // 32
HALF = ROWS // WGS  # rows of a warpgroup in the row-split phases

# Byte offsets inside the reused operand region (1024-byte aligned, for the 128-byte swizzle).


def region_bytes(passes: int = 3):
    """Bytes of (left image [64, K 128], right image [160, K 128], R^T image [256, K 64]) for
    `passes` (wgmma.image_k): 32, 80 and 64 KiB at three passes, half at one. The region holds
    left and right for the products, then R^T and the T^-1 image [64, K 64] after it."""
    return tuple(
        n * image_k(k, passes) * 2
        for n, k in ((ROWS, HEAD_DIM), (PACKED, HEAD_DIM), (2 * HEAD_DIM, ROWS))
    )


for _passes in (1, 3):  # R^T and the T^-1 image fit where the products' images were
    _left, _right, _rt = region_bytes(_passes)
    assert _rt + ROWS * image_k(ROWS, _passes) * 2 <= _left + _right


@dataclasses.dataclass(frozen=True)
class ChunkOperandsConfig:
    scale: float
    passes: int = 3  # bf16 passes a product: 3 (bf16x3) or 1


class ChunkOperandsSm90:
    def __init__(self, config: ChunkOperandsConfig):
        self.scale = float(config.scale)
        image_k(1, config.passes)  # 1 or 3
        self.passes = config.passes

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        g: cute.Tensor,
        beta: cute.Tensor,
        cu_seqlens: cute.Tensor,
        w: cute.Tensor,
        u: cute.Tensor,
        qg: cute.Tensor,
        attn: cute.Tensor,
        kd: cute.Tensor,
        decay: cute.Tensor,
        gamma: cute.Tensor,
        kk: cute.Tensor,
        tinv: cute.Tensor,
        stream: cuda.CUstream,
    ):
        n_slots = w.shape[0]
        heads = w.shape[1]
        mma_pairs = bf16_tiled_mma((ROWS, PACKED), warpgroup.OperandSource.SMEM)
        mma_solve = bf16_tiled_mma(
            (ROWS, 2 * HEAD_DIM), warpgroup.OperandSource.SMEM, b_mn_major=True
        )  # R^T written by channel: N-contiguous
        self.kernel(
            q, k, v, g, beta, cu_seqlens, w, u, qg, attn, kd, decay, gamma, kk, tinv, mma_pairs,
            mma_solve,
        ).launch(grid=[n_slots, heads, 1], block=[NTHREADS, 1, 1], stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mCu: cute.Tensor,
        mW: cute.Tensor,
        mU: cute.Tensor,
        mQg: cute.Tensor,
        mAttn: cute.Tensor,
        mKd: cute.Tensor,
        mDecay: cute.Tensor,
        mGamma: cute.Tensor,
        mKK: cute.Tensor,
        mTinv: cute.Tensor,
        mma_pairs: cute.TiledMma,
        mma_solve: cute.TiledMma,
    ):
        tid, _, _ = cute.arch.thread_idx()
        slot, h, _ = cute.arch.block_idx()
        d = tid % 128  # channel
        part = tid // 128  # warpgroup: 0 issues the wgmma
        scale = self.scale
        passes = self.passes
        left_bytes, right_bytes, rt_bytes = region_bytes(passes)
        region = left_bytes + right_bytes

        smem = SmemAllocator()
        row_major = cute.make_layout((ROWS, HEAD_DIM), stride=(HEAD_DIM, 1))
        s_region = smem.allocate_tensor(
            Int32, cute.make_layout(region // 4), 1024
        )  # the operand images, reused
        s_q = smem.allocate_tensor(BFloat16, row_major, 16)
        s_k = smem.allocate_tensor(BFloat16, row_major, 16)
        s_gam = smem.allocate_tensor(Float32, row_major, 16)
        s_beta = smem.allocate_tensor(Float32, cute.make_layout(ROWS), 16)
        pairs = cute.make_layout((ROWS, ROWS), stride=(PAIR_ROW, 1))
        s_kk = smem.allocate_tensor(Float32, pairs, 16)
        s_qk = smem.allocate_tensor(Float32, pairs, 16)  # then T^-1
        s_m = smem.allocate_tensor(
            Float32, cute.make_layout((BLOCKS - 1, BLOCK, BLOCK), stride=(BLOCK * 17, 17, 1)), 16
        )
        s_flag = smem.allocate_tensor(Int32, cute.make_layout(1), 4)

        raw = s_region.iterator
        s_left = view(raw, 0, image_layout(ROWS, image_k(HEAD_DIM, passes)))
        s_right = view(raw, left_bytes, image_layout(PACKED, image_k(HEAD_DIM, passes)))
        s_rt = view(raw, 0, image_layout(2 * HEAD_DIM, image_k(ROWS, passes), mn_major=True))
        s_tinv_img = view(raw, rt_bytes, image_layout(ROWS, image_k(ROWS, passes)))
        s_tinv = s_qk

        active, bos, seqlen, c = slot_owner(mCu, slot, SCAN_CHUNK)

        # ---- the chunk, thread (part, d) = channel d of rows [HALF part, HALF (part + 1)); Gamma
        # = cumsum g; zero past the end. The loads are unconditional (rows clamped into the
        # tensor, zeroed afterwards) so that a thread's are all in flight together.
        if tid == 0:
            s_flag[0] = Int32(0)
        tokens = mQ.shape[0]
        first = bos + c * ROWS + part * HALF
        last_ok = cutlass.min(bos + seqlen, tokens) - 1  # the last row this slot may read
        r_g = cute.make_rmem_tensor((HALF,), Float32)
        r_q = cute.make_rmem_tensor((HALF,), BFloat16)
        r_k = cute.make_rmem_tensor((HALF,), BFloat16)
        r_b = cute.make_rmem_tensor((HALF,), Float32)
        if tokens > 0:  # every sequence empty: slots but no rows to read
            for r in cutlass.range_constexpr(HALF):
                token = cutlass.max(cutlass.min(first + r, last_ok), 0)
                r_g[r] = mG[token, h, d]
                r_q[r] = mQ[token, h, d]
                r_k[r] = mK[token, h, d]
                r_b[r] = mBeta[token, h]
        gam = Float32(0.0)  # this warpgroup's rows' partial sum
        for r in cutlass.range_constexpr(HALF):
            i = part * HALF + r
            gv = Float32(0.0)
            qv = BFloat16(0.0)
            kv = BFloat16(0.0)
            bv = Float32(0.0)
            if active and c * ROWS + i < seqlen:
                gv = r_g[r]
                if gv < Float32(GATE_FLOOR):  # as xla.py: g = -inf resets; NaN stays NaN
                    gv = Float32(GATE_FLOOR)
                qv = r_q[r]
                kv = r_k[r]
                bv = r_b[r]
            gam = gam + gv
            s_gam[i, d] = gam
            s_q[i, d] = qv
            s_k[i, d] = kv
            if d == 0:
                s_beta[i] = bv
        cute.arch.sync_threads()
        # the later warpgroups' partial sums start from the rows before theirs
        g_before = Float32(0.0)
        for prev in cutlass.range_constexpr(1, WGS):
            if part >= prev:
                g_before = g_before + s_gam[prev * HALF - 1, d]
        cute.arch.sync_threads()  # every g_before read before any fix-up (WGS > 2)
        if part > 0:
            for r in cutlass.range_constexpr(HALF):
                s_gam[part * HALF + r, d] = s_gam[part * HALF + r, d] + g_before
        cute.arch.sync_threads()

        # ---- middle-row anchors where the decay allows, else first-row ones (chunk64.py)
        pairwise, shift = choose_anchors(s_gam, s_flag, d)
        # ---- the right operand: every anchor's factors, packed (chunk64.py)
        put_right_factors(s_right, s_k, s_gam, d, shift, pairwise, False, part, WGS, passes)
        cute.arch.sync_threads()

        mma_pairs.set(warpgroup.Field.ACCUMULATE, True)  # here: not inside the branches below
        mma_solve.set(warpgroup.Field.ACCUMULATE, True)
        thr = mma_pairs.get_slice(d)
        f_left = mma_pairs.make_fragment_A(thr.partition_A(s_left))
        f_right = mma_pairs.make_fragment_B(thr.partition_B(s_right))
        c_pairs = thr.partition_C(cute.make_identity_tensor((ROWS, PACKED)))
        acc = cute.make_rmem_tensor(mma_pairs.partition_shape_C((ROWS, PACKED)), Float32)
        # ---- kk, then qk: the left operand (k or q anchored at its block's anchor) x right
        for which in cutlass.range_constexpr(2):
            for i in cutlass.range(part, ROWS, WGS, unroll=8):
                anchor_row = (i // BLOCK) * BLOCK + shift
                x = s_k[i, d]
                if cutlass.const_expr(which == 1):
                    x = s_q[i, d]
                r = Float32(x) * cute.math.exp(s_gam[i, d] - s_gam[anchor_row, d])
                put_operand(s_left, i, d, HEAD_DIM, r, passes)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            if part == 0:
                product_passes(mma_pairs, acc, f_left, f_right, HEAD_DIM // 16, False, passes)
                s_out = s_kk if cutlass.const_expr(which == 0) else s_qk
                for e in cutlass.range_constexpr(cute.size(acc)):
                    i, p = c_pairs[e]
                    b, j = packed_row(p)
                    if i // BLOCK == b and j <= i:
                        if j < BLOCK * b or pairwise == Int32(0):
                            s_out[i, j] = acc[e]
            cute.arch.sync_threads()  # the left image is free again; the products are in place

        # ---- the diagonal blocks pair by pair where a block's decay range is not safe
        if pairwise != Int32(0):
            warp = tid // 32
            lane = tid % 32
            for pi in cutlass.range(warp, BLOCKS * BLOCK * BLOCK, WARPS, unroll=1):
                b = pi // (BLOCK * BLOCK)
                i = BLOCK * b + (pi // BLOCK) % BLOCK
                j = BLOCK * b + pi % BLOCK
                if j <= i:
                    part_kk = Float32(0.0)
                    part_qk = Float32(0.0)
                    for t in cutlass.range_constexpr(HEAD_DIM // 32):
                        ch = lane + 32 * t
                        e = cute.math.exp(s_gam[i, ch] - s_gam[j, ch])
                        kj_e = Float32(s_k[j, ch]) * e
                        part_kk = part_kk + Float32(s_k[i, ch]) * kj_e
                        part_qk = part_qk + Float32(s_q[i, ch]) * kj_e
                    for offset in cutlass.range_constexpr(5):
                        part_kk = part_kk + cute.arch.shuffle_sync_bfly(part_kk, 16 >> offset)
                        part_qk = part_qk + cute.arch.shuffle_sync_bfly(part_qk, 16 >> offset)
                    if lane == 0:
                        s_kk[i, j] = part_kk
                        s_qk[i, j] = part_qk
            cute.arch.sync_threads()

        # ---- Aqk and kk out (zero above the diagonal), coalesced
        for it in cutlass.range_constexpr(ROWS * ROWS // NTHREADS):
            e_idx = tid + it * NTHREADS
            i = e_idx // ROWS
            j = e_idx % ROWS
            a_ij = Float32(0.0)
            k_ij = Float32(0.0)
            if j <= i:
                a_ij = scale * s_qk[i, j]
                k_ij = s_kk[i, j]
            mAttn[slot, h, i, j] = a_ij
            mKK[slot, h, i, j] = k_ij
        cute.arch.sync_threads()  # s_qk is T^-1 from here

        # v (channel d of this warpgroup's rows) loads now, in registers, so the T^-1 phase
        # hides them
        r_v = cute.make_rmem_tensor((HALF,), Float32)  # rows HALF part + r
        for r in cutlass.range_constexpr(HALF):
            r_v[r] = Float32(0.0)
        if tokens > 0:
            for r in cutlass.range_constexpr(HALF):
                r_v[r] = Float32(mV[cutlass.max(cutlass.min(first + r, last_ok), 0), h, d])
        for r in cutlass.range_constexpr(HALF):
            if not (active and c * ROWS + part * HALF + r < seqlen):
                r_v[r] = Float32(0.0)

        # ---- T^-1, T = I + strictLower(beta_i kk_ij), float32 by 16-row blocks (chunk64.py)
        unit_lower_inverse(s_kk, s_beta, s_tinv, s_m, tid, NTHREADS)

        # ---- the solve's operand images: T^-1 (rows i, K = j) and R^T (rows = the 256 columns
        # [beta k exp(Gamma) | beta v], K = token)
        for it in cutlass.range_constexpr(ROWS * ROWS // NTHREADS):
            e_idx = tid + it * NTHREADS
            i = e_idx // ROWS
            j = e_idx % ROWS
            t_ij = s_tinv[i, j]
            put_operand(s_tinv_img, i, j, ROWS, t_ij, passes)
            mTinv[slot, h, i, j] = t_ij  # for the backward: its solve is then one product
        for r in cutlass.range_constexpr(HALF):
            t = part * HALF + r
            b_t = s_beta[t]
            r_k = b_t * Float32(s_k[t, d]) * cute.math.exp(s_gam[t, d])
            put_operand(s_rt, d, t, ROWS, r_k, passes)
            put_operand(s_rt, HEAD_DIM + d, t, ROWS, b_t * r_v[r], passes)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

        # ---- [W | U] = T^-1 R on tensor cores, straight out
        thr_s = mma_solve.get_slice(d)
        f_tinv = mma_solve.make_fragment_A(thr_s.partition_A(s_tinv_img))
        f_rt = mma_solve.make_fragment_B(thr_s.partition_B(s_rt))
        c_solve = thr_s.partition_C(cute.make_identity_tensor((ROWS, 2 * HEAD_DIM)))
        acc_s = cute.make_rmem_tensor(mma_solve.partition_shape_C((ROWS, 2 * HEAD_DIM)), Float32)
        if part == 0:
            product_passes(mma_solve, acc_s, f_tinv, f_rt, ROWS // 16, False, passes)
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                i, n = c_solve[e]
                if n < HEAD_DIM:
                    mW[slot, h, i, n] = acc_s[e]
                else:
                    mU[slot, h, i, n - HEAD_DIM] = acc_s[e]

        # ---- the elementwise operands
        gam_last = s_gam[ROWS - 1, d]
        for i in cutlass.range(part, ROWS, WGS, unroll=4):
            gam_i = s_gam[i, d]
            mQg[slot, h, i, d] = scale * Float32(s_q[i, d]) * cute.math.exp(gam_i)
            mKd[slot, h, i, d] = Float32(s_k[i, d]) * cute.math.exp(gam_last - gam_i)
            mGamma[slot, h, i, d] = gam_i
        if part == 0:
            mDecay[slot, h, d] = cute.math.exp(gam_last)
