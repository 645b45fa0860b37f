"""KDA (Kimi Delta Attention) forward, exact, sm_90a CuTe DSL: PREP (parallel), then EXPAND (the
serial chain), with BUILD and COMBINE between them when sequences are split into segments.

PREP, grid (S + 1, H), 128 threads, S = T//16 + N chunk slots. Sequence s owns slots
cu[s]//16 + s + c, c in [0, ceil(len_s / 16)); a CTA finds its sequence by binary search over
the device cu_seqlens (gap slots exit). Thread d = channel d:
  Gamma = cumsum g (rows past the end: q=k=v=g=beta=0), E = exp(Gamma),
  kw = k E, qg = scale q E, ub = beta k / E, a = exp(Gamma_15), kg = ub a           (f32)
  [Akk | Zf] = [kw; qg] ub^T on tensor cores, bf16x3 split (hi*hi + lo*hi + hi*lo: three
  K = 128 m64n16 wgmma products over [x_hi | x_lo], f32 accumulate) -> ~f32-accurate products
  wt = T^-1 kw, ut = T^-1 v with T = I + strictLower(Akk)  (f32 forward substitution)
(KdaConfig.prep, kernels' InputPrep: the inputs prepared as they load, every row's q and k
L2-normalised across the CTA by warp shuffles and four warps' partial sums, the safe gate made
from its raw projection with a_log and dt_bias (KdaForwardGateSm90 takes them), beta from
logits, q and k read at head h // G for grouped value heads; the plain kernel's code is as
without it) and writes one 21504-byte record per (slot, head) into ws[S, H, 1344, 4] int32,
laid out exactly as EXPAND's shared-memory stage (swizzled wgmma B tiles), so EXPAND copies raw
bytes:
  [0, 4096)      -wt   bf16 (16, 128)  K_SW128  (wgmma B, N = token, K = channel)
  [4096, 8192)   qg    bf16 (16, 128)  K_SW128
  [8192, 12288)  kg^T  bf16 (128, 16)  K_SW32   (N = channel, K = token)
  [12288, 12800) Z     bf16 (16, 16)   K_SW32   (tril(qg ub^T))
  [12800, 13312) a     f32  (128,)
  [13312, 21504) ut^T  f32  (128 v, 16 tokens), row-major; V-slab b reads bytes 13312 + 4096 b
EXPAND, grid (2, H, N + 1), 128 threads: each CTA owns 64 V rows of St (registers, wgmma RS
form) and walks its sequence's slots with a STAGES-deep cp.async (16-byte LDGSTS) pipeline of
17408-byte stages; per chunk: Rt = ut^T + St(-wt)^T; Ot = St qg^T + Rt Z^T; St = St Diag(a) + Rt kg.
Segmented (nseg = seg_states.shape[0] > 1, see plan.segment_count): EXPAND's grid is
(2, H, N * nseg + 1), segment p of a sequence walking chunks [p L, (p + 1) L), L = ceil(chunks /
nseg), from its start state. BUILD runs the same chain (no o) over segments 0 .. nseg-2 from
St = I without ut and from St = 0 with ut, giving the segment's affine map St_end = St_start Mt +
Ct (Ct float32; Mt as hi and lo bf16 wgmma B-operand images, 64 KiB like a float32 Mt); COMBINE,
grid (2, H, N), chains those maps from the initial state into every start state, one bf16x3
m64n128 wgmma product a segment, the next operator copied in while one is applied.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.warpgroup as warpgroup
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from jax_kda.constants import HEAD_DIM, L2_EPS
from jax_kda.sm90.kernels.input_prep import InputPrep, kda_gate
from jax_kda.sm90.kernels.layout import CHUNK, CHUNK_RECORD_BYTES
from jax_kda.sm90.kernels.varlen import sequence_slots, slot_owner
from jax_kda.sm90.kernels.wgmma import (
    acc_to_a_operand,
    bf16_tiled_mma,
    image_layout,
    split_a_operands,
    vec4,
    view,
)

NTHREADS = 128
WARPS = NTHREADS // 32
VS = 64  # V rows per EXPAND CTA
REC_BYTES = CHUNK_RECORD_BYTES  # per (slot, head) record
REC_VEC = REC_BYTES // 16  # 1344 16-byte vectors
STAGE_BYTES = 17408  # what one V-slab needs of a record
STAGE_VEC = STAGE_BYTES // 16  # 1088
COMMON_VEC = 13312 // 16  # 832 vectors shared by both slabs
UT_VEC = 4096 // 16  # 256 vectors of ut^T per slab
OFF_WT, OFF_QG, OFF_KG, OFF_Z, OFF_A, OFF_UT = 0, 4096, 8192, 12288, 12800, 13312
PROD_ROW = 17
IMAGE_BYTES = HEAD_DIM * HEAD_DIM * 2  # one bf16 image of a segment operator
OPERATOR_VEC = 2 * IMAGE_BYTES // 16  # hi and lo images of Mt, in 16-byte vectors (64 KiB)
CT_SLAB_VEC = VS * HEAD_DIM * 4 // 16  # one V-slab's rows of Ct (float32), 16-byte vectors
COMBINE_BUFFER_VEC = OPERATOR_VEC + CT_SLAB_VEC  # one COMBINE stage: Mt images + Ct rows


@dataclasses.dataclass(frozen=True)
class KdaConfig:
    num_heads: int
    scale: float = HEAD_DIM**-0.5
    stages: int = 4  # EXPAND cp.async pipeline depth (chunks in flight = stages - 1)
    prep: InputPrep | None = None  # the inputs prepared in PREP as it loads them (None: as given)

    def __post_init__(self):
        if not (self.num_heads >= 1):
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        min_stages = -(-2 * IMAGE_BYTES // STAGE_BYTES)  # BUILD stages Mt's images in them
        if not (min_stages <= self.stages <= 8):
            raise ValueError(f"stages must be in [{min_stages}, 8], got {self.stages}")
        if self.prep is not None and self.prep.gate and self.prep.lower_bound is None:
            raise ValueError(
                "KdaConfig: the gate-bound kernels take the in-kernel gate only with a "
                "lower_bound (the safe gate); the softplus gate has no bound"
            )


def _b_layouts():
    lay_nk128 = cute.tile_to_shape(
        warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16),
        (CHUNK, HEAD_DIM),
        order=(0, 1),
    )
    lay_z = cute.tile_to_shape(
        warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW32, BFloat16),
        (CHUNK, CHUNK),
        order=(0, 1),
    )
    lay_kg = cute.tile_to_shape(
        warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW32, BFloat16),
        (HEAD_DIM, CHUNK),
        order=(0, 1),
    )
    return lay_nk128, lay_z, lay_kg


@cute.jit
def _load_stage(atom, g_rec, s_raw, stage, vslab, tid):
    """Issue this thread's cp.async copies of one chunk record into shared-memory stage `stage`:
    the parts both V-slabs use, then this slab's half of ut^T."""
    for it in cutlass.range_constexpr((STAGE_VEC + NTHREADS - 1) // NTHREADS):
        idx = tid + it * NTHREADS
        if idx < STAGE_VEC:
            src = idx
            if idx >= COMMON_VEC:
                src = idx + vslab * UT_VEC
            cute.copy(atom, vec4(g_rec[src, None].iterator), vec4(s_raw[idx, None, stage].iterator))


@cute.jit
def _load_operator(atom, mSegOps, nseg, p, n, h, vbase, s_raw, buf, tid):
    """Issue this thread's cp.async copies of operator p's Mt images (64 KiB) and this
    slab's rows of Ct_p (32 KiB) into COMBINE buffer `buf`."""
    g_m = cute.make_tensor(
        cute.recast_ptr(mSegOps[p, n, h, None, None].iterator, dtype=Int32),
        cute.make_layout((OPERATOR_VEC, 4), stride=(4, 1)),
    )
    g_ct = cute.make_tensor(
        cute.recast_ptr(
            mSegOps[(nseg - 1) + p, n, h, None, None].iterator + vbase * HEAD_DIM,
            dtype=Int32,
        ),
        cute.make_layout((CT_SLAB_VEC, 4), stride=(4, 1)),
    )
    for it in cutlass.range_constexpr(OPERATOR_VEC // NTHREADS):
        idx = tid + it * NTHREADS
        cute.copy(atom, vec4(g_m[idx, None].iterator), vec4(s_raw[idx, None, buf].iterator))
    for it in cutlass.range_constexpr(CT_SLAB_VEC // NTHREADS):
        idx = tid + it * NTHREADS
        dst = s_raw[OPERATOR_VEC + idx, None, buf].iterator
        cute.copy(atom, vec4(g_ct[idx, None].iterator), vec4(dst))


class KdaForwardSm90:
    def __init__(self, config: KdaConfig):
        self.H = config.num_heads
        self.scale = float(config.scale)
        self.stages = config.stages
        self.prep = config.prep if config.prep is not None else InputPrep()

    # ------------------------------------------------------------------ launcher
    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        g: cute.Tensor,
        beta: cute.Tensor,
        cu_seqlens: cute.Tensor,
        initial_state: cute.Tensor,
        o: cute.Tensor,
        final_state: cute.Tensor,
        ws_rec: cute.Tensor,
        seg_states: cute.Tensor,
        seg_ops: cute.Tensor,
        stream: cuda.CUstream,
    ):
        self.launch(
            q, k, v, g, beta, cu_seqlens, initial_state, o, final_state, ws_rec, seg_states,
            seg_ops, None, None, stream,
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
        initial_state: cute.Tensor,
        o: cute.Tensor,
        final_state: cute.Tensor,
        ws_rec: cute.Tensor,
        seg_states: cute.Tensor,
        seg_ops: cute.Tensor,
        a_log: cute.Tensor | None,
        dt_bias: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        n_seq = cu_seqlens.shape[0] - 1
        n_slots = ws_rec.shape[0]
        nseg = seg_states.shape[0]  # segments per sequence; 1: no BUILD / COMBINE
        mma_prep = bf16_tiled_mma((64, CHUNK), warpgroup.OperandSource.SMEM)
        mma_n16 = bf16_tiled_mma((VS, CHUNK), warpgroup.OperandSource.RMEM)
        mma_n128 = bf16_tiled_mma((VS, HEAD_DIM), warpgroup.OperandSource.RMEM)
        assert str(mma_n16.tv_layout_A) == str(mma_n16.tv_layout_C), "wgmma C/A TV layouts differ"
        # +1: never a 0-sized grid (N = 0 / T = 0); the extra CTAs find no chunk and exit
        self.prep_kernel(q, k, v, g, beta, cu_seqlens, ws_rec, mma_prep, a_log, dt_bias).launch(
            grid=[n_slots + 1, self.H, 1], block=[NTHREADS, 1, 1], stream=stream
        )

        chain_args = (cu_seqlens, initial_state, seg_states, seg_ops, o, final_state, ws_rec)
        chain_args += (mma_n16, mma_n128)
        if nseg > 1:
            # BUILD: Mt and Ct of every segment but the last
            self._launch_chain(chain_args, True, n_seq * (nseg - 1) * 2, stream)
            self.combine_kernel(cu_seqlens, initial_state, seg_states, seg_ops, mma_n128).launch(
                grid=[2, self.H, n_seq], block=[NTHREADS, 1, 1], stream=stream
            )
        self._launch_chain(chain_args, False, n_seq * nseg + 1, stream)  # EXPAND (+1: never 0)

    def _launch_chain(self, args, build: bool, ctas_per_slab_and_head, stream):
        self.chain_kernel(*args, build).launch(
            grid=[2, self.H, ctas_per_slab_and_head], block=[NTHREADS, 1, 1], stream=stream
        )

    # ------------------------------------------------------------------ PREP
    @cute.kernel
    def prep_kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mCu: cute.Tensor,
        mWs: cute.Tensor,
        mma: cute.TiledMma,
        mALog: cute.Tensor | None = None,
        mDtBias: cute.Tensor | None = None,
    ):
        tid, _, _ = cute.arch.thread_idx()
        slot, h, _ = cute.arch.block_idx()
        scale = self.scale
        d = tid

        smem = SmemAllocator()
        lay_a = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16),
            (64, 2 * HEAD_DIM),
            order=(0, 1),
        )
        lay_b = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16),
            (CHUNK, 2 * HEAD_DIM),
            order=(0, 1),
        )
        s_A = smem.allocate_tensor(BFloat16, lay_a.outer, 1024, swizzle=lay_a.inner)
        s_B = smem.allocate_tensor(BFloat16, lay_b.outer, 1024, swizzle=lay_b.inner)
        s_rec = smem.allocate_tensor(Int32, cute.make_layout((REC_VEC, 4), stride=(4, 1)), 1024)
        s_prod = smem.allocate_tensor(
            Float32, cute.make_layout((2 * CHUNK, CHUNK), stride=(PROD_ROW, 1)), 16
        )
        prepared = self.prep != InputPrep()  # the plain kernel's code stays as it was
        s_norm = None
        if cutlass.const_expr(self.prep.qk_l2norm):
            # the L2 norm's per-warp partial sums of squares, [q | k, warp, row]
            s_norm = smem.allocate_tensor(
                Float32, cute.make_layout((2, WARPS, CHUNK), stride=(WARPS * CHUNK, CHUNK, 1)), 16
            )
        lay_nk128, lay_z, lay_kg = _b_layouts()
        raw = s_rec.iterator
        s_wt = view(raw, OFF_WT, lay_nk128)
        s_qg = view(raw, OFF_QG, lay_nk128)
        s_kg = view(raw, OFF_KG, lay_kg)
        s_z = view(raw, OFF_Z, lay_z)
        s_a = cute.make_tensor(
            cute.recast_ptr(raw + OFF_A // 4, dtype=Float32), cute.make_layout(HEAD_DIM)
        )
        s_ut = cute.make_tensor(
            cute.recast_ptr(raw + OFF_UT // 4, dtype=Float32),
            cute.make_layout((HEAD_DIM, CHUNK), stride=(CHUNK, 1)),
        )

        active, bos, seqlen, c = slot_owner(mCu, slot, CHUNK)
        h_qk = h  # the q and k head this value head reads
        if cutlass.const_expr(self.prep.grouped_qk):
            h_qk = h // (mV.shape[1] // mQ.shape[1])
        bias = Float32(0.0)  # the in-kernel gate's dt_bias (channel d) and amplitude
        amplitude = Float32(1.0)
        if cutlass.const_expr(self.prep.gate):
            bias = mDtBias[h, d]
            amplitude = cute.math.exp(mALog[h])
        if active:
            eos = bos + seqlen
            r_kw = cute.make_rmem_tensor((CHUNK,), Float32)
            r_v = cute.make_rmem_tensor((CHUNK,), Float32)
            r_ub = cute.make_rmem_tensor((CHUNK,), Float32)
            r_wt = cute.make_rmem_tensor((CHUNK,), Float32)
            r_ut = cute.make_rmem_tensor((CHUNK,), Float32)
            r_q = cute.make_rmem_tensor((CHUNK,), Float32)
            r_g = cute.make_rmem_tensor((CHUNK,), Float32)
            r_b = cute.make_rmem_tensor((CHUNK,), Float32)
            r_mask = cute.make_rmem_tensor((CHUNK,), Float32)
            # Every load of the chunk first, so that all 80 are in flight at once (issued
            # inside the dependent loop below they would each wait a full memory latency).
            for i in cutlass.range_constexpr(CHUNK):
                rr = c * CHUNK + i
                row = bos + rr
                mk = Float32(1.0)
                if rr >= seqlen:
                    row = eos - 1
                    mk = Float32(0.0)
                if cutlass.const_expr(prepared):
                    r_g[i] = mG[row, h, d]
                else:
                    r_g[i] = mG[row, h, d] * mk
                r_kw[i] = Float32(mK[row, h_qk, d]) * mk
                r_q[i] = Float32(mQ[row, h_qk, d]) * mk
                r_v[i] = Float32(mV[row, h, d]) * mk
                if cutlass.const_expr(prepared):
                    r_b[i] = mBeta[row, h]
                    r_mask[i] = mk
                else:
                    r_b[i] = mBeta[row, h] * mk
            if cutlass.const_expr(prepared):
                # the in-kernel preparations (InputPrep) on the loaded values; rows past the
                # end come out zero, as the plain kernel loads them
                for i in cutlass.range_constexpr(CHUNK):
                    gv = r_g[i]
                    if cutlass.const_expr(self.prep.gate):
                        gv = kda_gate(gv + bias, amplitude, self.prep.lower_bound)
                    r_g[i] = gv * r_mask[i]
                    bv = r_b[i]
                    if cutlass.const_expr(self.prep.beta_logits):
                        bv = Float32(1.0) / (Float32(1.0) + cute.math.exp(-bv))
                    r_b[i] = bv * r_mask[i]
                if cutlass.const_expr(self.prep.qk_l2norm):
                    self.l2_normalize_rows(r_q, r_kw, s_norm, tid)
            gam = Float32(0.0)
            for i in cutlass.range_constexpr(CHUNK):
                gv = r_g[i]
                kv = r_kw[i]
                qv = r_q[i]
                bv = r_b[i]
                gam = gam + gv
                e = cute.math.exp(gam)
                kw = kv * e
                qg = (scale * qv) * e
                ub = (bv * kv) / e
                r_kw[i] = kw
                r_ub[i] = ub
                kw_hi = kw.to(BFloat16)
                kw_lo = (kw - Float32(kw_hi)).to(BFloat16)
                qg_hi = qg.to(BFloat16)
                qg_lo = (qg - Float32(qg_hi)).to(BFloat16)
                ub_hi = ub.to(BFloat16)
                ub_lo = (ub - Float32(ub_hi)).to(BFloat16)
                # A rows [x_hi | x_lo], B rows [u_hi | u_lo]
                s_A[i, d] = kw_hi
                s_A[i, HEAD_DIM + d] = kw_lo
                s_A[CHUNK + i, d] = qg_hi
                s_A[CHUNK + i, HEAD_DIM + d] = qg_lo
                s_B[i, d] = ub_hi
                s_B[i, HEAD_DIM + d] = ub_lo
                s_qg[i, d] = qg_hi
            a_d = cute.math.exp(gam)
            s_a[d] = a_d
            for i in cutlass.range_constexpr(CHUNK):
                s_kg[d, i] = (r_ub[i] * a_d).to(BFloat16)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()

            # ---- [kw; qg; *; *] (64 x 128) x ub^T (128 x 16) on tensor cores, as
            # hi hi^T + lo hi^T + hi lo^T: three K = 128 products over the hi / lo halves
            thr = mma.get_slice(tid)
            fA = mma.make_fragment_A(thr.partition_A(s_A))
            fB = mma.make_fragment_B(thr.partition_B(s_B))
            acc = cute.make_rmem_tensor(mma.partition_shape_C((64, CHUNK)), Float32)
            cprod = thr.partition_C(cute.make_identity_tensor((64, CHUNK)))
            cute.nvgpu.warpgroup.fence()
            klo = HEAD_DIM // 16  # first k-block of the lo half
            for kb in cutlass.range_constexpr(HEAD_DIM // 16):
                mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(mma, acc, fA[None, None, kb], fB[None, None, kb], acc)
                mma.set(warpgroup.Field.ACCUMULATE, True)
                cute.gemm(mma, acc, fA[None, None, klo + kb], fB[None, None, kb], acc)
                cute.gemm(mma, acc, fA[None, None, kb], fB[None, None, klo + kb], acc)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(0)
            for i in cutlass.range_constexpr(cute.size(acc)):
                m, j = cprod[i]
                if m < 2 * CHUNK:
                    s_prod[m, j] = acc[i]
            cute.arch.sync_threads()

            # ---- Z = tril(qg ub^T), thread -> row zi, cols zj, zj + 8
            zi = tid // 8
            zj = tid % 8
            z0 = Float32(0.0)
            z1 = Float32(0.0)
            if zj <= zi:
                z0 = s_prod[CHUNK + zi, zj]
            if zj + 8 <= zi:
                z1 = s_prod[CHUNK + zi, zj + 8]
            s_z[zi, zj] = z0.to(BFloat16)
            s_z[zi, zj + 8] = z1.to(BFloat16)

            # ---- forward substitution, thread d = column d (f32). No shared-memory store
            # inside, so the compiler may issue the (broadcast) loads of Akk ahead of the chain.
            for i in cutlass.range_constexpr(CHUNK):
                w = r_kw[i]
                u = r_v[i]
                for j in cutlass.range_constexpr(i):
                    aij = s_prod[i, j]
                    w = w - aij * r_wt[j]
                    u = u - aij * r_ut[j]
                r_wt[i] = w
                r_ut[i] = u
            for i in cutlass.range_constexpr(CHUNK):
                s_wt[i, d] = (-r_wt[i]).to(BFloat16)
                s_ut[d, i] = r_ut[i]
            cute.arch.sync_threads()

            # ---- record -> workspace (16-byte vectors, coalesced)
            g_rec = mWs[slot, h, None, None]
            for it in cutlass.range_constexpr((REC_VEC + NTHREADS - 1) // NTHREADS):
                idx = tid + it * NTHREADS
                if idx < REC_VEC:
                    vec4(g_rec[idx, None].iterator).store(vec4(s_rec[idx, None].iterator).load())

    @cute.jit
    def l2_normalize_rows(self, r_q, r_k, s_norm, tid):
        """q and k's CHUNK rows (thread = channel d; r_q[i], r_k[i] its float32 values of row i)
        *= rsqrt(the row's sum of squares + 1e-6), then rounded to bf16 (gate.l2_normalize, as
        the XLA preparation hands the kernel bf16 rows): each warp sums its 32 channels by
        butterfly shuffles, lane 0 puts the warp's partial sums into s_norm, and every thread
        adds the warps' in order. Synchronises the CTA (all threads call it)."""
        warp = tid // 32
        lane = tid % 32
        for i in cutlass.range_constexpr(CHUNK):
            sq = r_q[i] * r_q[i]
            sk = r_k[i] * r_k[i]
            for step in cutlass.range_constexpr(5):
                sq = sq + cute.arch.shuffle_sync_bfly(sq, offset=1 << step)
                sk = sk + cute.arch.shuffle_sync_bfly(sk, offset=1 << step)
            if lane == 0:
                s_norm[0, warp, i] = sq
                s_norm[1, warp, i] = sk
        cute.arch.sync_threads()
        for i in cutlass.range_constexpr(CHUNK):
            sq = Float32(0.0)
            sk = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                sq = sq + s_norm[0, w, i]
                sk = sk + s_norm[1, w, i]
            r_q[i] = Float32((r_q[i] * cute.math.rsqrt(sq + Float32(L2_EPS))).to(BFloat16))
            r_k[i] = Float32((r_k[i] * cute.math.rsqrt(sk + Float32(L2_EPS))).to(BFloat16))

    # ------------------------------------------------------------------ EXPAND
    @cute.kernel
    def chain_kernel(
        self,
        mCu: cute.Tensor,
        mS0: cute.Tensor,
        mSegStates: cute.Tensor,
        mSegOps: cute.Tensor,
        mO: cute.Tensor,
        mSf: cute.Tensor,
        mWs: cute.Tensor,
        mma_n16: cute.TiledMma,
        mma_n128: cute.TiledMma,
        build: cutlass.Constexpr,
    ):
        """The serial chain over one segment's chunks, 64 rows of a [128, 128] operand per CTA.

        EXPAND (build=False), block z = n * nseg + p: the state St of segment p of sequence n,
        seeded from the segment's start state (the initial state when nseg == 1); writes o for
        the segment's tokens and, for the last segment, the final state.
        BUILD (build=True), block z = (n * (nseg - 1) + p) * 2 + which: the segment operators of
        St_end = St_start Mt + Ct, walking the same chunks from X = I without ut (which = 0, Mt)
        or from X = 0 with ut (which = 1, Ct), written to mSegOps[which * (nseg - 1) + p, n, h].
        """
        tid, _, _ = cute.arch.thread_idx()
        vslab, h, z = cute.arch.block_idx()
        P = self.stages
        n_seq = mCu.shape[0] - 1
        nseg = mSegStates.shape[0]
        vbase = vslab * VS
        if cutlass.const_expr(build):
            n = z // (2 * (nseg - 1))
            p = (z // 2) % (nseg - 1)
            which = z % 2
        else:
            n = z // nseg
            p = z % nseg
            which = 1

        smem = SmemAllocator()
        s_raw = smem.allocate_tensor(
            Int32, cute.make_layout((STAGE_VEC, 4, P), stride=(4, 1, STAGE_BYTES // 4)), 1024
        )
        raw = s_raw.iterator
        lay_nk128, lay_z, lay_kg = _b_layouts()
        s_wt = view(raw, OFF_WT, lay_nk128, P, STAGE_BYTES)
        s_qg = view(raw, OFF_QG, lay_nk128, P, STAGE_BYTES)
        s_kg = view(raw, OFF_KG, lay_kg, P, STAGE_BYTES)
        s_z = view(raw, OFF_Z, lay_z, P, STAGE_BYTES)
        s_a = cute.make_tensor(
            cute.recast_ptr(raw + OFF_A // 4, dtype=Float32),
            cute.make_layout((HEAD_DIM, P), stride=(1, STAGE_BYTES // 4)),
        )
        s_ut = cute.make_tensor(
            cute.recast_ptr(raw + OFF_UT // 4, dtype=Float32),
            cute.make_layout((VS, CHUNK, P), stride=(CHUNK, 1, STAGE_BYTES // 4)),
        )

        thr16 = mma_n16.get_slice(tid)
        thr128 = mma_n128.get_slice(tid)
        rB_wt = mma_n16.make_fragment_B(thr16.partition_B(s_wt))
        rB_qg = mma_n16.make_fragment_B(thr16.partition_B(s_qg))
        rB_z = mma_n16.make_fragment_B(thr16.partition_B(s_z))
        rB_kg = mma_n128.make_fragment_B(thr128.partition_B(s_kg))
        c16 = thr16.partition_C(cute.make_identity_tensor((VS, CHUNK)))
        c128 = thr128.partition_C(cute.make_identity_tensor((VS, HEAD_DIM)))

        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), Int32, num_bits_per_copy=128
        )  # cp.async.cg (L2 only)

        if n < n_seq:
            bos, seqlen, nchunks, first_slot = sequence_slots(mCu, n, CHUNK)
            seg_chunks = (nchunks + nseg - 1) // nseg
            first = cutlass.min(p * seg_chunks, nchunks)
            count = cutlass.min(first + seg_chunks, nchunks) - first
            slot0 = first_slot + first
            acc_s = cute.make_rmem_tensor(mma_n128.partition_shape_C((VS, HEAD_DIM)), Float32)
            acc_r = cute.make_rmem_tensor(mma_n16.partition_shape_C((VS, CHUNK)), Float32)
            acc_o = cute.make_rmem_tensor(mma_n16.partition_shape_C((VS, CHUNK)), Float32)
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                m, col = c128[i]
                if cutlass.const_expr(build):
                    acc_s[i] = Float32(0.0)
                    if which == 0:
                        if vbase + m == col:
                            acc_s[i] = Float32(1.0)
                else:
                    if nseg > 1:
                        acc_s[i] = mSegStates[p, n, h, vbase + m, col]
                    else:
                        acc_s[i] = mS0[n, h, vbase + m, col]

            # prologue: chunks 0 .. P-2 in flight (one commit group per chunk, maybe empty)
            for j in cutlass.range_constexpr(P - 1):
                if j < count:
                    _load_stage(atom, mWs[slot0 + j, h, None, None], s_raw, j, vslab, tid)
                cute.arch.cp_async_commit_group()

            for j in cutlass.range(count, unroll=1):
                stage = j % P
                cute.arch.cp_async_wait_group(P - 2)  # this thread's part of chunk j landed
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_threads()  # chunk j visible to all; chunk j-1's stage is free
                nxt = j + (P - 1)
                if nxt < count:
                    nstage = nxt % P
                    g_rec = mWs[slot0 + nxt, h, None, None]
                    _load_stage(atom, g_rec, s_raw, nstage, vslab, tid)
                cute.arch.cp_async_commit_group()

                a_st = acc_to_a_operand(mma_n128, acc_s, VS, HEAD_DIM)
                for i in cutlass.range_constexpr(cute.size(acc_r)):
                    m, jj = c16[i]
                    acc_r[i] = Float32(0.0)
                    if which == 1:
                        acc_r[i] = s_ut[m, jj, stage]
                cute.nvgpu.warpgroup.fence()
                mma_n16.set(warpgroup.Field.ACCUMULATE, True)
                for kb in cutlass.range_constexpr(HEAD_DIM // 16):
                    cute.gemm(
                        mma_n16, acc_r, a_st[None, None, kb], rB_wt[None, None, kb, stage], acc_r
                    )
                cute.nvgpu.warpgroup.commit_group()
                if cutlass.const_expr(not build):
                    # St qg^T, off the state's chain: its group may still run while Rt is
                    # converted and St scaled (it reads a_st and writes acc_o, neither touched)
                    for kb in cutlass.range_constexpr(HEAD_DIM // 16):
                        mma_n16.set(warpgroup.Field.ACCUMULATE, kb != 0)
                        cute.gemm(
                            mma_n16,
                            acc_o,
                            a_st[None, None, kb],
                            rB_qg[None, None, kb, stage],
                            acc_o,
                        )
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(1)  # Rt is done
                else:
                    cute.nvgpu.warpgroup.wait_group(0)

                a_rt = acc_to_a_operand(mma_n128, acc_r, VS, CHUNK)
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    m, col = c128[i]
                    acc_s[i] = acc_s[i] * s_a[col, stage]
                cute.nvgpu.warpgroup.fence()
                mma_n128.set(warpgroup.Field.ACCUMULATE, True)
                cute.gemm(mma_n128, acc_s, a_rt[None, None, 0], rB_kg[None, None, 0, stage], acc_s)
                if cutlass.const_expr(not build):
                    mma_n16.set(warpgroup.Field.ACCUMULATE, True)
                    cute.gemm(
                        mma_n16, acc_o, a_rt[None, None, 0], rB_z[None, None, 0, stage], acc_o
                    )
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(0)

                if cutlass.const_expr(not build):
                    for i in cutlass.range_constexpr(cute.size(acc_o)):
                        m, jj = c16[i]
                        rr = (first + j) * CHUNK + jj
                        if rr < seqlen:
                            mO[bos + rr, h, vbase + m] = acc_o[i].to(BFloat16)

            cute.arch.cp_async_wait_group(0)
            if cutlass.const_expr(build):
                if which == 0:
                    # Mt rows [vbase, vbase + 64) -> this slab's K half of the operator's hi and
                    # lo bf16 B-operand images: staged in the idle stage buffers (the swizzle
                    # goes by shared-memory address), then copied out as raw bytes, which
                    # COMBINE copies back into shared memory. A K half of an image is its
                    # 16 KiB half (the layout's K mode is the outer one).
                    cute.arch.sync_threads()  # every thread is done with the stages
                    lay_m = image_layout(HEAD_DIM, HEAD_DIM)
                    s_hi = view(raw, 0, lay_m)
                    s_lo = view(raw, IMAGE_BYTES, lay_m)
                    for i in cutlass.range_constexpr(cute.size(acc_s)):
                        m, col = c128[i]
                        x = acc_s[i]
                        x_hi = x.to(BFloat16)
                        s_hi[col, vbase + m] = x_hi
                        s_lo[col, vbase + m] = (x - Float32(x_hi)).to(BFloat16)
                    cute.arch.sync_threads()
                    s_vec = cute.make_tensor(
                        raw, cute.make_layout((OPERATOR_VEC, 4), stride=(4, 1))
                    )
                    g_vec = cute.make_tensor(
                        cute.recast_ptr(mSegOps[p, n, h, None, None].iterator, dtype=Int32),
                        cute.make_layout((OPERATOR_VEC, 4), stride=(4, 1)),
                    )
                    half_vec = IMAGE_BYTES // 32  # 16-byte vectors in one K half of an image
                    for image in cutlass.range_constexpr(2):
                        for it in cutlass.range_constexpr(half_vec // NTHREADS):
                            idx = image * 2 * half_vec + vslab * half_vec + tid + it * NTHREADS
                            vec4(g_vec[idx, None].iterator).store(
                                vec4(s_vec[idx, None].iterator).load()
                            )
                else:
                    for i in cutlass.range_constexpr(cute.size(acc_s)):
                        m, col = c128[i]
                        mSegOps[(nseg - 1) + p, n, h, vbase + m, col] = acc_s[i]
            else:
                if p == nseg - 1:
                    for i in cutlass.range_constexpr(cute.size(acc_s)):
                        m, col = c128[i]
                        mSf[n, h, vbase + m, col] = acc_s[i]

    # ------------------------------------------------------------------ COMBINE
    @cute.kernel
    def combine_kernel(
        self,
        mCu: cute.Tensor,
        mS0: cute.Tensor,
        mSegStates: cute.Tensor,
        mSegOps: cute.Tensor,
        mma: cute.TiledMma,
    ):
        """Start states of every segment: S_{p+1} = S_p Mt_p + Ct_p, float32 state and Ct.

        Block (slab, h, n) owns 64 rows of the [V, K] state in registers, as EXPAND does. Each
        step is a bf16x3 wgmma product (S_hi Mt_hi + S_lo Mt_hi + S_hi Mt_lo: about float32
        accuracy) onto Ct; BUILD left Mt as hi and lo B-operand images, so a two-stage cp.async
        pipeline copies operator p + 1 and its Ct rows while step p runs. An empty segment (past
        the sequence's last chunk; every segment of an empty sequence) is no step at all: its map
        is the identity, and skipping it keeps the state bit-exact (S_hi + S_lo is not S).
        """
        tid, _, _ = cute.arch.thread_idx()
        vslab, h, n = cute.arch.block_idx()
        nseg = mSegStates.shape[0]
        vbase = vslab * VS
        _, _, nchunks, _ = sequence_slots(mCu, n, CHUNK)
        seg_chunks = (nchunks + nseg - 1) // nseg  # as chain_kernel cuts the sequence

        smem = SmemAllocator()
        s_raw = smem.allocate_tensor(
            Int32,
            cute.make_layout((COMBINE_BUFFER_VEC, 4, 2), stride=(4, 1, COMBINE_BUFFER_VEC * 4)),
            1024,
        )
        raw = s_raw.iterator
        buffer_bytes = COMBINE_BUFFER_VEC * 16
        lay_m = image_layout(HEAD_DIM, HEAD_DIM)
        s_hi = view(raw, 0, lay_m, 2, buffer_bytes)
        s_lo = view(raw, IMAGE_BYTES, lay_m, 2, buffer_bytes)
        s_ct = cute.make_tensor(
            cute.recast_ptr(raw + 2 * IMAGE_BYTES // 4, dtype=Float32),
            cute.make_layout((VS, HEAD_DIM, 2), stride=(HEAD_DIM, 1, buffer_bytes // 4)),
        )
        thr = mma.get_slice(tid)
        rB_hi = mma.make_fragment_B(thr.partition_B(s_hi))
        rB_lo = mma.make_fragment_B(thr.partition_B(s_lo))
        c128 = thr.partition_C(cute.make_identity_tensor((VS, HEAD_DIM)))
        acc = cute.make_rmem_tensor(mma.partition_shape_C((VS, HEAD_DIM)), Float32)
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), Int32, num_bits_per_copy=128
        )

        for i in cutlass.range_constexpr(cute.size(acc)):
            m, col = c128[i]
            x = mS0[n, h, vbase + m, col]
            acc[i] = x
            mSegStates[0, n, h, vbase + m, col] = x
        if nseg > 1:
            _load_operator(atom, mSegOps, nseg, 0, n, h, vbase, s_raw, 0, tid)
        cute.arch.cp_async_commit_group()

        for p in cutlass.range(nseg - 1, unroll=1):
            buf = p % 2
            cute.arch.cp_async_wait_group(0)  # this thread's copies of operator p landed
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()  # operator p visible to all; step p - 1's buffer is free
            if p + 1 < nseg - 1:
                _load_operator(atom, mSegOps, nseg, p + 1, n, h, vbase, s_raw, 1 - buf, tid)
            cute.arch.cp_async_commit_group()

            if p * seg_chunks < nchunks:  # segment p holds chunks (uniform per CTA)
                a_hi, a_lo = split_a_operands(mma, acc, VS, HEAD_DIM)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    m, col = c128[i]
                    acc[i] = s_ct[m, col, buf]
                cute.nvgpu.warpgroup.fence()
                mma.set(warpgroup.Field.ACCUMULATE, True)
                for kb in cutlass.range_constexpr(HEAD_DIM // 16):
                    cute.gemm(mma, acc, a_hi[None, None, kb], rB_hi[None, None, kb, buf], acc)
                    cute.gemm(mma, acc, a_lo[None, None, kb], rB_hi[None, None, kb, buf], acc)
                    cute.gemm(mma, acc, a_hi[None, None, kb], rB_lo[None, None, kb, buf], acc)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(0)
            for i in cutlass.range_constexpr(cute.size(acc)):
                m, col = c128[i]
                mSegStates[p + 1, n, h, vbase + m, col] = acc[i]
        cute.arch.cp_async_wait_group(0)


class KdaForwardGateSm90(KdaForwardSm90):
    """The forward with the gate made in PREP (InputPrep.gate, with its lower_bound): g is the
    raw gate projection a, and a_log [H] and dt_bias [H, 128] (float32) come after
    cu_seqlens."""

    def __init__(self, config: KdaConfig):
        super().__init__(config)
        if not self.prep.gate:
            raise ValueError("KdaForwardGateSm90 is the variant with InputPrep(gate=True)")

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        g: cute.Tensor,
        beta: cute.Tensor,
        cu_seqlens: cute.Tensor,
        a_log: cute.Tensor,
        dt_bias: cute.Tensor,
        initial_state: cute.Tensor,
        o: cute.Tensor,
        final_state: cute.Tensor,
        ws_rec: cute.Tensor,
        seg_states: cute.Tensor,
        seg_ops: cute.Tensor,
        stream: cuda.CUstream,
    ):
        self.launch(
            q, k, v, g, beta, cu_seqlens, initial_state, o, final_state, ws_rec, seg_states,
            seg_ops, a_log, dt_bias, stream,
        )  # fmt: skip
