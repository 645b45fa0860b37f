"""One decode step (jax_kda.decode) on the GPU, sm_90a CuTe DSL: every state read once and
written once, nothing else of size. H200, 2026-12-03 (benchmarks/results/2026-12-03-h200-decode.md):
1.37x-1.57x of the HBM floor from 64 sequences x 16 heads up, pools as fast as dense states.

Per sequence n and value head j, with the stored state St [V, K] (prefill's layout, float32),
a = exp(max(g, GATE_FLOOR)) and the token's q, k (head j // G of q and k's heads, G = HV / H),
v, beta, each row s of St (one value channel) is independent of the others:

  x = s * a;  p_k = x . k;  p_q = x . q;  c = beta (v_row - p_k)
  s' = x + c k;  o_row = scale (p_q + c (k . q))

(o = scale St' q written out: St' q = p_q + c (k . q)), which is decode_step._step row by row.

A warp takes ROWS rows of one (n, j), a lane channels 4 lane .. 4 lane + 3 of each (one
16-byte load and store a row); every row's load is issued before the first row's arithmetic,
and the rows' sums run through the butterfly together. A CTA of WARPS warps covers WARPS *
ROWS rows; grid (N * V / (WARPS * ROWS), HV): N on x, whose extent may pass 65535.

Pooled (DecodeConfig.pooled): the state is a pool [P, HV, V, K], and sequence n reads and
writes row indices[n]; an index outside [0, P) reads a zero state and writes nothing. The
state is updated in place (the FFI call aliases it to its result).

Inputs: q, k [N, H, 128] and v [N, HV, 128] bfloat16, g [N, HV, 128] and beta [N, HV]
float32, indices [N] int32 (read only when pooled), state [N or P, HV, 128, 128] float32.
Output: o [N, HV, 128] bfloat16; the state, in place.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from jax_kda.constants import GATE_FLOOR, HEAD_DIM
from jax_kda.sm90.kernels.chunk64 import exp_fast
from jax_kda.sm90.kernels.layout import DECODE_CTAS_PER_HEAD, DECODE_ROWS_PER_WARP, DECODE_WARPS
from jax_kda.sm90.kernels.wgmma import row_piece

WARPS = DECODE_WARPS
NTHREADS = 32 * WARPS
LANE_CHANNELS = HEAD_DIM // 32  # 4: a 16-byte float32 piece of a row a lane
ROWS = DECODE_ROWS_PER_WARP  # rows a warp: their loads in flight together
CTA_ROWS = WARPS * ROWS
CTAS_PER_HEAD = DECODE_CTAS_PER_HEAD  # HEAD_DIM // CTA_ROWS (layout.py derives it)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    scale: float
    pooled: bool  # the state is a pool read and written at indices[n]


class DecodeSm90:
    def __init__(self, config: DecodeConfig):
        self.scale = float(config.scale)
        self.pooled = config.pooled

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        g: cute.Tensor,
        beta: cute.Tensor,
        indices: cute.Tensor,
        state: cute.Tensor,
        o: cute.Tensor,
        stream: cuda.CUstream,
    ):
        self.kernel(q, k, v, g, beta, indices, state, o).launch(
            grid=[CTAS_PER_HEAD * v.shape[0], v.shape[1], 1],
            block=[NTHREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mIdx: cute.Tensor,
        mState: cute.Tensor,
        mO: cute.Tensor,
    ):
        tid, _, _ = cute.arch.thread_idx()
        bx, j, _ = cute.arch.block_idx()
        part = bx % CTAS_PER_HEAD
        n = bx // CTAS_PER_HEAD
        warp = tid // 32
        lane = tid % 32
        c0 = lane * LANE_CHANNELS
        h = j // (mV.shape[1] // mQ.shape[1])  # grouped value heads: q and k head j // G
        row0 = part * CTA_ROWS + warp * ROWS

        srow = n
        live = True
        if cutlass.const_expr(self.pooled):
            srow = mIdx[n]
            live = srow >= Int32(0) and srow < mState.shape[0]

        # the rows' loads first (a zero state where the pool index is out of range)
        s = cute.make_rmem_tensor((ROWS, LANE_CHANNELS), Float32)
        s.fill(0.0)
        if live:
            for r in cutlass.range_constexpr(ROWS):
                piece = cute.make_rmem_tensor((LANE_CHANNELS,), Float32)
                cute.autovec_copy(row_piece(mState[srow, j, row0 + r, None], c0, LANE_CHANNELS),
                                  piece)  # fmt: skip
                for c in cutlass.range_constexpr(LANE_CHANNELS):
                    s[r, c] = piece[c]
        vals = cute.make_rmem_tensor((ROWS,), Float32)
        for r in cutlass.range_constexpr(ROWS):
            vals[r] = Float32(mV[n, j, row0 + r])
        b = mBeta[n, j]

        kv = cute.make_rmem_tensor((LANE_CHANNELS,), Float32)
        qv = cute.make_rmem_tensor((LANE_CHANNELS,), Float32)
        av = cute.make_rmem_tensor((LANE_CHANNELS,), Float32)
        kq = Float32(0.0)
        for c in cutlass.range_constexpr(LANE_CHANNELS):
            kv[c] = Float32(mK[n, h, c0 + c])
            qv[c] = Float32(mQ[n, h, c0 + c])
            gc = mG[n, j, c0 + c]
            if gc < Float32(GATE_FLOOR):  # as xla.py: g = -inf resets; NaN stays NaN
                gc = Float32(GATE_FLOOR)
            av[c] = exp_fast(gc)
            kq = kq + kv[c] * qv[c]

        # x = s * a; the rows' p_k and p_q partial sums, then one butterfly for all of them
        pk = cute.make_rmem_tensor((ROWS,), Float32)
        pq = cute.make_rmem_tensor((ROWS,), Float32)
        for r in cutlass.range_constexpr(ROWS):
            pk[r] = Float32(0.0)
            pq[r] = Float32(0.0)
            for c in cutlass.range_constexpr(LANE_CHANNELS):
                x = s[r, c] * av[c]
                s[r, c] = x
                pk[r] = pk[r] + x * kv[c]
                pq[r] = pq[r] + x * qv[c]
        for step in cutlass.range_constexpr(5):
            kq = kq + cute.arch.shuffle_sync_bfly(kq, offset=16 >> step)
            for r in cutlass.range_constexpr(ROWS):
                pk[r] = pk[r] + cute.arch.shuffle_sync_bfly(pk[r], offset=16 >> step)
                pq[r] = pq[r] + cute.arch.shuffle_sync_bfly(pq[r], offset=16 >> step)

        # s' = x + c k out (in place), o's rows: lane r writes row r's
        for r in cutlass.range_constexpr(ROWS):
            corr = b * (vals[r] - pk[r])
            piece = cute.make_rmem_tensor((LANE_CHANNELS,), Float32)
            for c in cutlass.range_constexpr(LANE_CHANNELS):
                piece[c] = s[r, c] + corr * kv[c]
            if live:
                cute.autovec_copy(piece, row_piece(mState[srow, j, row0 + r, None], c0,
                                                   LANE_CHANNELS))  # fmt: skip
            if lane == r:
                mO[n, j, row0 + r] = (self.scale * (pq[r] + corr * kq)).to(BFloat16)
