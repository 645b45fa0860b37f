"""The chunk core's backward from its products' cotangents to the tokens' gradients, sm_90a CuTe
DSL: the element-wise terms, dg's reverse cumsum and the scatter back into the tokens' rows, one
pass over each chunk after the dense and decayed backward kernels (xla._elementwise_bwd, then
xla.from_chunks).

Per row i and channel d of a chunk, with Gamma the chunk core's in-chunk cumsum of g, E =
exp(Gamma), F = exp(Gamma_last - Gamma) (Kd's factor), qg = scale q E and kd = k F:
  dq = dq_c + scale E dQg;  dk = dk_c + beta E dRhs_w + F dKd;  dv = beta dRhs_u;
  dbeta = dbeta_kk + sum_d (dRhs_w k E + dRhs_u v);
  dGamma = dgamma_c + beta k E dRhs_w + qg dQg - kd dKd, and on the last row
    sum_i kd dKd + exp(Gamma_last) dA;  dg = the reverse cumsum of dGamma over the rows,
where (dq_c, dk_c, dgamma_c) are the decayed products' backward (kda_decayed_bwd_sm90.py),
(dRhs = [dRhs_w | dRhs_u], dQg, dKd, dA, dbeta_kk) the dense kernel's (kda_dense_bwd_sm90.py).
Rows past a sequence's end take q = k = v = beta = 0 (as the chunked tokens have them) and are
not written; gap slots write nothing.

Memory-bound, so built for occupancy: no shared operands, one CTA of eight row groups a (slot,
head, half of the channels), two CTAs an SM, thread (group, d) = channel d of the half and the
group's 8 rows, loads issued BATCH rows at a time (each row's loads coalesced). Half the channels
a CTA keeps the SMs' last wave full where a call has few chunks (2048x12x1: 768 CTAs, 2.9 waves
of 264, against 1.45 waves with whole chunks); dbeta's sum over the channels then comes in two
partial sums, one a half, that the caller adds. Writes stay inside the
token rows whatever cu_seqlens holds (bad boundaries give garbage, never an out-of-bounds
access).

Inputs: q, k, v [T, H, 128] bfloat16, g [T, H, 128] and beta [T, H] float32 (the tokens; g
only for dg's gate-floor rule, xla.gate_floor_grad), cu_seqlens [N + 1]
int32; per slot and head, float32: gamma, dq_c, dk_c, dgamma_c [64, 128], d_decay [128],
d_beta_kk [64]; bfloat16 in the exported artifact (the dense kernel's; float32 taken as well):
d_qg, d_kd [64, 128], d_rhs [64, 256]. Outputs: dq, dk, dv [T, H, 128] bfloat16 (the
tokens' dtype: the float32 sums rounded once, as the caller's cast would), dg [T, H, 128] and
dbeta_parts [2, T, H] float32 (dbeta = their sum: the first holds d_beta_kk and the first half's
channels, the second the other half's).
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.memory import SmemAllocator

from jax_kda.constants import GATE_FLOOR, HEAD_DIM, SCAN_CHUNK
from jax_kda.sm90.kernels.chunk64 import exp_fast
from jax_kda.sm90.kernels.varlen import slot_rows

ROWS = SCAN_CHUNK
CH = HEAD_DIM // 2  # channels a CTA
HALVES = HEAD_DIM // CH
GROUPS = 8  # row groups of a CTA, CH threads each
NTHREADS = CH * GROUPS
GROUP_ROWS = ROWS // GROUPS
BATCH = 2  # rows whose loads are issued before any of their arithmetic
PER_SM = 2  # CTAs an SM: registers capped at 64 (no spills at BATCH = 2)
WARPS = CH // 32  # warps across a row's channels
LOADS = 12  # values a thread loads per row


@dataclasses.dataclass(frozen=True)
class TokensBwdConfig:
    scale: float


class TokensBwdSm90:
    def __init__(self, config: TokensBwdConfig):
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
        gamma: cute.Tensor,
        dq_c: cute.Tensor,
        dk_c: cute.Tensor,
        dgamma_c: cute.Tensor,
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
        self.kernel(
            q, k, v, g, beta, cu_seqlens, gamma, dq_c, dk_c, dgamma_c, d_rhs, d_qg, d_kd, d_decay,
            d_beta_kk, dq, dk, dv, dg, dbeta,
        ).launch(
            grid=[gamma.shape[0], gamma.shape[1], HALVES], block=[NTHREADS, 1, 1], stream=stream,
            min_blocks_per_mp=PER_SM, preferred_smem_carveout=100,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mCu: cute.Tensor,
        mGamma: cute.Tensor,
        mDqC: cute.Tensor,
        mDkC: cute.Tensor,
        mDgamC: cute.Tensor,
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
    ):
        tid, _, _ = cute.arch.thread_idx()
        slot, h, half = cute.arch.block_idx()
        d = half * CH + tid % CH  # this thread's channel
        group = tid // CH
        warp = (tid % CH) // 32
        lane = tid % 32
        scale = self.scale

        smem = SmemAllocator()
        # per group: its rows' dGamma sum and kd dKd sum, by the CTA's channel
        s_sums = smem.allocate_tensor(
            Float32, cute.make_layout((GROUPS, 2, CH), stride=(2 * CH, CH, 1)), 16
        )
        # dbeta's per-warp partial sums over a row's channels
        s_rows = smem.allocate_tensor(
            Float32, cute.make_layout((ROWS, WARPS), stride=(WARPS, 1)), 16
        )

        # The slot's own values first, then the token rows' owner; token loads unconditional
        # (rows clamped into the tensor, the values zeroed afterwards) so that a batch's loads
        # all issue before its arithmetic waits on them.
        gam_last = mGamma[slot, h, ROWS - 1, d]
        d_decay = mDdecay[slot, h, d]
        tokens = mQ.shape[0]
        row0, count = slot_rows(mCu, slot, tokens, SCAN_CHUNK)
        r_dgam = cute.make_rmem_tensor((GROUP_ROWS,), Float32)
        r_in = cute.make_rmem_tensor((BATCH, LOADS), Float32)
        kd_sum = Float32(0.0)
        for bt in cutlass.range_constexpr(GROUP_ROWS // BATCH):
            for r in cutlass.range_constexpr(BATCH):
                i = group * GROUP_ROWS + bt * BATCH + r
                r_in[r, 0] = mGamma[slot, h, i, d]
                r_in[r, 1] = mDqC[slot, h, i, d]
                r_in[r, 2] = mDkC[slot, h, i, d]
                r_in[r, 3] = mDgamC[slot, h, i, d]
                r_in[r, 4] = Float32(mDrhs[slot, h, i, d])
                r_in[r, 5] = Float32(mDrhs[slot, h, i, HEAD_DIM + d])
                r_in[r, 6] = Float32(mDqg[slot, h, i, d])
                r_in[r, 7] = Float32(mDkd[slot, h, i, d])
                qv = BFloat16(0.0)
                kv = BFloat16(0.0)
                vv = BFloat16(0.0)
                bv = Float32(0.0)
                if tokens > 0:
                    token = cutlass.max(cutlass.min(row0 + i, tokens - 1), 0)
                    qv = mQ[token, h, d]
                    kv = mK[token, h, d]
                    vv = mV[token, h, d]
                    bv = mBeta[token, h]
                r_in[r, 8] = Float32(qv)
                r_in[r, 9] = Float32(kv)
                r_in[r, 10] = Float32(vv)
                r_in[r, 11] = bv
            for r in cutlass.range_constexpr(BATCH):
                i = group * GROUP_ROWS + bt * BATCH + r
                valid = i < count
                gam = r_in[r, 0]
                d_rw = r_in[r, 4]
                d_ru = r_in[r, 5]
                d_qg = r_in[r, 6]
                d_kd = r_in[r, 7]
                qv = r_in[r, 8]
                kv = r_in[r, 9]
                vv = r_in[r, 10]
                b = r_in[r, 11]
                if not valid:
                    qv = Float32(0.0)
                    kv = Float32(0.0)
                    vv = Float32(0.0)
                    b = Float32(0.0)
                e = exp_fast(gam)
                f = exp_fast(gam_last - gam)
                kd_term = kv * f * d_kd
                kd_sum = kd_sum + kd_term
                d_gam = r_in[r, 3] + b * kv * e * d_rw + scale * qv * e * d_qg
                r_dgam[bt * BATCH + r] = d_gam - kd_term
                term = d_rw * kv * e + d_ru * vv
                for offset in cutlass.range_constexpr(5):
                    term = term + cute.arch.shuffle_sync_bfly(term, offset=16 >> offset)
                if lane == 0:
                    s_rows[i, warp] = term
                if valid:
                    token = row0 + i
                    mDq[token, h, d] = (r_in[r, 1] + scale * e * d_qg).to(BFloat16)
                    mDk[token, h, d] = (r_in[r, 2] + b * e * d_rw + f * d_kd).to(BFloat16)
                    mDv[token, h, d] = (b * d_ru).to(BFloat16)

        # the gates of the group's rows, for the floor's rule on dg below (loads issued together)
        r_g = cute.make_rmem_tensor((GROUP_ROWS,), Float32)
        for r in cutlass.range_constexpr(GROUP_ROWS):
            r_g[r] = Float32(0.0)
            if group * GROUP_ROWS + r < count:
                r_g[r] = mG[row0 + group * GROUP_ROWS + r, h, d]

        # dg: the reverse cumsum within the group's rows, then the later groups' sums and the
        # last row's terms (every row's kd dKd and the chunk decay's a dA) onto every row; then
        # through the gate floor max(g, GATE_FLOOR): whole above it, half at it, none below
        run = Float32(0.0)
        for r in cutlass.range_constexpr(GROUP_ROWS):
            run = run + r_dgam[GROUP_ROWS - 1 - r]
            r_dgam[GROUP_ROWS - 1 - r] = run
        s_sums[group, 0, tid % CH] = run
        s_sums[group, 1, tid % CH] = kd_sum
        cute.arch.sync_threads()
        last = exp_fast(gam_last) * d_decay
        for p in cutlass.range_constexpr(GROUPS):
            last = last + s_sums[p, 1, tid % CH]
            if group < p:
                last = last + s_sums[p, 0, tid % CH]
        for r in cutlass.range_constexpr(GROUP_ROWS):
            i = group * GROUP_ROWS + r
            if i < count:
                total_dg = r_dgam[r] + last
                floored = Float32(0.0)
                if r_g[r] == Float32(GATE_FLOOR):
                    floored = Float32(0.5) * total_dg
                if r_g[r] > Float32(GATE_FLOOR):
                    floored = total_dg
                mDg[row0 + i, h, d] = floored
        if tid < ROWS:
            i = tid
            if i < count:
                total = Float32(0.0)
                if half == 0:
                    total = mDbetaKk[slot, h, i]
                for w in cutlass.range_constexpr(WARPS):
                    total = total + s_rows[i, w]
                mDbeta[half, row0 + i, h] = total
