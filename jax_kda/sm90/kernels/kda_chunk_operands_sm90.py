"""The exact 64-token chunk core, sm_90a CuTe DSL: every chunk's state-independent operands,
parallel over (chunk slot, head). What xla._chunk_operands computes, read straight from the
packed tokens (no chunked copy of the inputs), plus two of its backward's residuals.

Per slot (64 rows; rows past the sequence's end and gap slots read as q = k = v = g = beta = 0),
with Gamma the in-chunk cumsum of g:
  kk_ij = sum_d k_id k_jd exp(Gamma_id - Gamma_jd), qk_ij alike with q_i, for j <= i
  Aqk = scale * qk (j <= i), L = strictLower(beta_i kk_ij)
  [W | U] = (I + L)^-1 [beta k exp(Gamma) | beta v]
  Qg = scale q exp(Gamma), Kd = k exp(Gamma_last - Gamma), a = exp(Gamma_last)
The decay is never factorised: each pair (i, j) takes exp(Gamma_i - Gamma_j) <= 1 itself, so no
operand can overflow for any g <= 0; gates below constants.GATE_FLOOR are taken as it, as in
xla.py, so Gamma stays finite for g = -inf.

One CTA of 128 threads a (slot, head). Thread d = channel d loads the chunk (coalesced) and takes
the cumsum; each warp takes rows i = warp (mod 4) of the pairwise products, a pair's 128 channels
split over the lanes and summed by shuffles; thread d then solves columns d (W) and 128 + d (U)
by forward substitution against L in shared memory, in float32.

Outputs, float32: w, u, qg, kd, gamma [slots, H, 64, 128]; attn, kk [slots, H, 64, 64] (zero
above the diagonal); decay [slots, H, 128]. Not yet run on a GPU.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.memory import SmemAllocator

from jax_kda.constants import GATE_FLOOR, HEAD_DIM, SCAN_CHUNK
from jax_kda.sm90.kernels.varlen import slot_owner

NTHREADS = 128
WARPS = NTHREADS // 32
PAIR_ROW = SCAN_CHUNK + 1  # padded rows of the products in shared memory


@dataclasses.dataclass(frozen=True)
class ChunkOperandsConfig:
    scale: float


class ChunkOperandsSm90:
    def __init__(self, config: ChunkOperandsConfig):
        self.scale = float(config.scale)

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
        stream: cuda.CUstream,
    ):
        n_slots = w.shape[0]
        heads = w.shape[1]
        self.kernel(q, k, v, g, beta, cu_seqlens, w, u, qg, attn, kd, decay, gamma, kk).launch(
            grid=[n_slots, heads, 1], block=[NTHREADS, 1, 1], stream=stream
        )

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
    ):
        tid, _, _ = cute.arch.thread_idx()
        slot, h, _ = cute.arch.block_idx()
        d = tid
        scale = self.scale
        rows = SCAN_CHUNK

        smem = SmemAllocator()
        row_major = cute.make_layout((rows, HEAD_DIM), stride=(HEAD_DIM, 1))
        s_q = smem.allocate_tensor(BFloat16, row_major, 16)
        s_k = smem.allocate_tensor(BFloat16, row_major, 16)
        s_v = smem.allocate_tensor(BFloat16, row_major, 16)
        s_gam = smem.allocate_tensor(Float32, row_major, 16)
        s_beta = smem.allocate_tensor(Float32, cute.make_layout(rows), 16)
        pairs = cute.make_layout((rows, rows), stride=(PAIR_ROW, 1))
        s_kk = smem.allocate_tensor(Float32, pairs, 16)
        s_qk = smem.allocate_tensor(Float32, pairs, 16)
        s_x = smem.allocate_tensor(
            Float32, cute.make_layout((rows, 2 * HEAD_DIM), stride=(2 * HEAD_DIM, 1)), 16
        )

        active, bos, seqlen, c = slot_owner(mCu, slot, SCAN_CHUNK)

        # ---- the chunk, thread d = channel d; Gamma = cumsum g; zero past the end
        gam = Float32(0.0)
        for i in cutlass.range(rows, unroll=4):
            row = c * rows + i
            gv = Float32(0.0)
            qv = BFloat16(0.0)
            kv = BFloat16(0.0)
            vv = BFloat16(0.0)
            bv = Float32(0.0)
            if active and row < seqlen:
                token = bos + row
                gv = mG[token, h, d]
                if gv < Float32(GATE_FLOOR):  # as xla.py: g = -inf resets; NaN stays NaN
                    gv = Float32(GATE_FLOOR)
                qv = mQ[token, h, d]
                kv = mK[token, h, d]
                vv = mV[token, h, d]
                bv = mBeta[token, h]
            gam = gam + gv
            s_gam[i, d] = gam
            s_q[i, d] = qv
            s_k[i, d] = kv
            s_v[i, d] = vv
            if d == 0:
                s_beta[i] = bv
        cute.arch.sync_threads()

        # ---- pairwise decayed products, j <= i: warp w takes rows w, w + 4, ...
        warp = tid // 32
        lane = tid % 32
        for i in cutlass.range(warp, rows, WARPS, unroll=1):
            for j in cutlass.range(i + 1, unroll=1):
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
        for it in cutlass.range_constexpr(rows * rows // NTHREADS):
            e_idx = tid + it * NTHREADS
            i = e_idx // rows
            j = e_idx % rows
            a_ij = Float32(0.0)
            k_ij = Float32(0.0)
            if j <= i:
                a_ij = scale * s_qk[i, j]
                k_ij = s_kk[i, j]
            mAttn[slot, h, i, j] = a_ij
            mKK[slot, h, i, j] = k_ij

        # ---- [W | U] = (I + L)^-1 [beta k E | beta v], thread d: columns d and 128 + d
        gam_last = s_gam[rows - 1, d]
        for i in cutlass.range(rows, unroll=1):
            gam_i = s_gam[i, d]
            e_i = cute.math.exp(gam_i)
            b_i = s_beta[i]
            k_i = Float32(s_k[i, d])
            x_w = b_i * k_i * e_i
            x_u = b_i * Float32(s_v[i, d])
            for j in cutlass.range(i, unroll=4):
                l_ij = b_i * s_kk[i, j]
                x_w = x_w - l_ij * s_x[j, d]
                x_u = x_u - l_ij * s_x[j, HEAD_DIM + d]
            s_x[i, d] = x_w
            s_x[i, HEAD_DIM + d] = x_u
            mW[slot, h, i, d] = x_w
            mU[slot, h, i, d] = x_u
            mQg[slot, h, i, d] = scale * Float32(s_q[i, d]) * e_i
            mKd[slot, h, i, d] = k_i * cute.math.exp(gam_last - gam_i)
            mGamma[slot, h, i, d] = gam_i
        mDecay[slot, h, d] = cute.math.exp(gam_last)
