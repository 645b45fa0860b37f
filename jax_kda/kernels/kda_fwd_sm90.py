"""KDA (Kimi Delta Attention) forward, exact, one fused sm_90a CuTe DSL kernel.

Grid (VSPLIT, H, N); 128 threads (one warpgroup). Each CTA owns a slab of VS = 128 / VSPLIT
rows of the transposed float32 state St = S^T ([V, K]) of one (head, sequence) and walks the
sequence's 16-token chunks serially. The state lives in registers as a wgmma accumulator
(m64n128, f32) and is fed back to wgmma as a bf16 register A operand (RS form).

Per chunk (thread d = channel d in the prep part):
  load q, k, v (bf16), g (f32), beta (f32) rows bos+16c .. (rows past the end: q=k=v=0, g=0,
  beta=0, so the chunk is the identity on those rows); Gamma = cumsum g; E = exp(Gamma);
  kw = k E; qg = scale q E; ub = beta k / E  (f32, in smem)
  Akk = strictLower(kw ub^T), Z = tril(qg ub^T)        (f32 SIMT dots over K=128)
  wt = T^-1 kw, ut = T^-1 v, T = I + Akk              (forward substitution, f32)
  a = exp(Gamma_15), kg = ub a
  Rt = ut^T - St wt^T            wgmma m64n16k16 x8, A = bf16(St) regs, B = -wt (smem, bf16)
  Ot = St qg^T + Rt Z^T          wgmma m64n16k16 x8 (+1), A = bf16(St) / bf16(Rt) regs
  St = St Diag(a) + Rt kg        wgmma m64n128k16 x1, A = bf16(Rt) regs, B = kg^T (smem)
The math is emulated in float64 by emulate.py.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.warpgroup as warpgroup
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32
from cutlass.memory import SmemAllocator

from jax_kda.constants import CHUNK, HEAD_DIM

NTHREADS = 128
F32_ROW = 132  # padded row stride of the f32 smem scratch (16B aligned, 4-bank shift per row)


@dataclasses.dataclass(frozen=True)
class KdaConfig:
    num_heads: int
    scale: float = HEAD_DIM**-0.5
    head_dim: int = HEAD_DIM
    v_split: int = 2  # CTAs per (head, sequence); each owns 128 / v_split state rows

    def __post_init__(self):
        if self.head_dim != HEAD_DIM:
            raise ValueError(f"head_dim must be {HEAD_DIM}, got {self.head_dim}")
        if self.v_split not in (2,):
            raise ValueError(f"v_split must be 2 (64-row slabs), got {self.v_split}")
        if not (self.num_heads >= 1):
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")


class KdaForwardSm90:
    def __init__(self, config: KdaConfig):
        self.cfg = config
        self.H = config.num_heads
        self.scale = float(config.scale)
        self.vsplit = config.v_split
        self.vs = HEAD_DIM // config.v_split  # 64 state rows per CTA = one wgmma M tile

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
        stream: cuda.CUstream,
    ):
        n_seq = cu_seqlens.shape[0] - 1
        mma_n16 = sm90_utils.make_trivial_tiled_mma(
            BFloat16,
            BFloat16,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            Float32,
            (1, 1, 1),
            (self.vs, CHUNK),
            warpgroup.OperandSource.RMEM,
        )
        mma_n128 = sm90_utils.make_trivial_tiled_mma(
            BFloat16,
            BFloat16,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            Float32,
            (1, 1, 1),
            (self.vs, HEAD_DIM),
            warpgroup.OperandSource.RMEM,
        )
        # the acc -> A-operand register reuse relies on identical C and A thread-value layouts
        assert str(mma_n16.tv_layout_A) == str(mma_n16.tv_layout_C), "wgmma C/A TV layouts differ"
        self.kernel(
            q, k, v, g, beta, cu_seqlens, initial_state, o, final_state, mma_n16, mma_n128
        ).launch(
            grid=[self.vsplit, self.H, n_seq],
            block=[NTHREADS, 1, 1],
            stream=stream,
        )

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _acc_to_a_operand(mma: cute.TiledMma, acc: cute.Tensor, m: int, kdim: int) -> cute.Tensor:
        """bf16 copy of an m64nN f32 wgmma accumulator as the register A operand of an m64 x kdim
        (kdim = N) wgmma. The wgmma C and A thread-value layouts coincide per k16 block (checked at
        trace time on tv_layout_A/tv_layout_C: ((4,8,4),(2,2,2)):((128,1,16),(64,8,512))), and per
        thread the accumulator's (2,2,N/8) values and the A fragment's ((2,2,2), 1, N/16) values
        have the same linear register order, so a plain elementwise convert is the relayout."""
        frag = mma.make_fragment_A(mma.partition_shape_A((m, kdim)))
        frag_as_acc = cute.make_tensor(frag.iterator, acc.layout)
        frag_as_acc.store(acc.load().to(BFloat16))
        return frag

    # ------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mCu: cute.Tensor,
        mS0: cute.Tensor,
        mO: cute.Tensor,
        mSf: cute.Tensor,
        mma_n16: cute.TiledMma,
        mma_n128: cute.TiledMma,
    ):
        tid, _, _ = cute.arch.thread_idx()
        vslab, h, n = cute.arch.block_idx()
        VS = self.vs
        scale = self.scale
        vbase = vslab * VS

        bos = mCu[n]
        eos = mCu[n + 1]
        seqlen = eos - bos
        nchunks = (seqlen + (CHUNK - 1)) // CHUNK

        # ---------------- shared memory
        smem = SmemAllocator()
        f32_layout = cute.make_layout((CHUNK, HEAD_DIM), stride=(F32_ROW, 1))
        s_kw = smem.allocate_tensor(Float32, f32_layout, 16)
        s_qg = smem.allocate_tensor(Float32, f32_layout, 16)
        s_ub = smem.allocate_tensor(Float32, f32_layout, 16)
        s_ut = smem.allocate_tensor(Float32, f32_layout, 16)
        s_akk = smem.allocate_tensor(
            Float32, cute.make_layout((CHUNK, CHUNK), stride=(CHUNK + 1, 1)), 16
        )
        s_a = smem.allocate_tensor(Float32, cute.make_layout(HEAD_DIM), 16)

        # wgmma B operands, [N, K] K-major, bf16, swizzled canonical layouts
        lay_b_nk128 = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16),
            (CHUNK, HEAD_DIM),
            order=(0, 1),
        )
        lay_b_z = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW32, BFloat16),
            (CHUNK, CHUNK),
            order=(0, 1),
        )
        lay_b_kg = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW32, BFloat16),
            (HEAD_DIM, CHUNK),
            order=(0, 1),
        )
        s_wt = smem.allocate_tensor(BFloat16, lay_b_nk128.outer, 1024, swizzle=lay_b_nk128.inner)
        s_qgb = smem.allocate_tensor(BFloat16, lay_b_nk128.outer, 1024, swizzle=lay_b_nk128.inner)
        s_z = smem.allocate_tensor(BFloat16, lay_b_z.outer, 1024, swizzle=lay_b_z.inner)
        s_kgt = smem.allocate_tensor(BFloat16, lay_b_kg.outer, 1024, swizzle=lay_b_kg.inner)

        # ---------------- MMA partitions
        thr16 = mma_n16.get_slice(tid)
        thr128 = mma_n128.get_slice(tid)
        rB_wt = mma_n16.make_fragment_B(thr16.partition_B(s_wt))
        rB_qg = mma_n16.make_fragment_B(thr16.partition_B(s_qgb))
        rB_z = mma_n16.make_fragment_B(thr16.partition_B(s_z))
        rB_kg = mma_n128.make_fragment_B(thr128.partition_B(s_kgt))

        c16 = thr16.partition_C(cute.make_identity_tensor((VS, CHUNK)))
        c128 = thr128.partition_C(cute.make_identity_tensor((VS, HEAD_DIM)))

        acc_s = cute.make_rmem_tensor(mma_n128.partition_shape_C((VS, HEAD_DIM)), Float32)
        acc_r = cute.make_rmem_tensor(mma_n16.partition_shape_C((VS, CHUNK)), Float32)
        acc_o = cute.make_rmem_tensor(mma_n16.partition_shape_C((VS, CHUNK)), Float32)

        # ---------------- initial state -> registers
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            m, col = c128[i]
            acc_s[i] = mS0[n, h, vbase + m, col]

        # per-thread (channel d = tid) chunk registers
        r_kw = cute.make_rmem_tensor((CHUNK,), Float32)
        r_v = cute.make_rmem_tensor((CHUNK,), Float32)
        r_ub = cute.make_rmem_tensor((CHUNK,), Float32)
        r_wt = cute.make_rmem_tensor((CHUNK,), Float32)
        r_ut = cute.make_rmem_tensor((CHUNK,), Float32)
        d = tid

        for c in cutlass.range(nchunks, unroll=1):
            cute.arch.sync_threads()  # previous chunk's smem consumers are done
            # ---------- phase 1: gate cumsum and scaled operands, thread d = channel d
            gam = Float32(0.0)
            for i in cutlass.range_constexpr(CHUNK):
                rr = c * CHUNK + i
                row = bos + rr
                mk = Float32(1.0)
                if rr >= seqlen:
                    row = eos - 1
                    mk = Float32(0.0)
                gv = mG[row, h, d] * mk
                kv = Float32(mK[row, h, d]) * mk
                qv = Float32(mQ[row, h, d]) * mk
                vv = Float32(mV[row, h, d]) * mk
                bv = mBeta[row, h] * mk
                gam = gam + gv
                e = cute.math.exp(gam)
                kw = kv * e
                qg = (scale * qv) * e
                ub = (bv * kv) / e
                r_kw[i] = kw
                r_v[i] = vv
                r_ub[i] = ub
                s_kw[i, d] = kw
                s_qg[i, d] = qg
                s_ub[i, d] = ub
                s_qgb[i, d] = qg.to(BFloat16)
            a_d = cute.math.exp(gam)
            s_a[d] = a_d
            for i in cutlass.range_constexpr(CHUNK):
                s_kgt[d, i] = (r_ub[i] * a_d).to(BFloat16)
            cute.arch.sync_threads()

            # ---------- phase 2: 16x16 products (f32), thread -> row i, cols j0, j0+8
            pi = tid // 8
            pj0 = tid % 8
            pj1 = pj0 + 8
            dk0 = Float32(0.0)
            dk1 = Float32(0.0)
            dq0 = Float32(0.0)
            dq1 = Float32(0.0)
            for dd in cutlass.range(HEAD_DIM, unroll=8):
                xk = s_kw[pi, dd]
                xq = s_qg[pi, dd]
                u0 = s_ub[pj0, dd]
                u1 = s_ub[pj1, dd]
                dk0 = dk0 + xk * u0
                dk1 = dk1 + xk * u1
                dq0 = dq0 + xq * u0
                dq1 = dq1 + xq * u1
            akk0 = Float32(0.0)
            akk1 = Float32(0.0)
            z0 = Float32(0.0)
            z1 = Float32(0.0)
            if pj0 < pi:
                akk0 = dk0
            if pj1 < pi:
                akk1 = dk1
            if pj0 <= pi:
                z0 = dq0
            if pj1 <= pi:
                z1 = dq1
            s_akk[pi, pj0] = akk0
            s_akk[pi, pj1] = akk1
            s_z[pi, pj0] = z0.to(BFloat16)
            s_z[pi, pj1] = z1.to(BFloat16)
            cute.arch.sync_threads()

            # ---------- phase 3: forward substitution, thread d = column d
            for i in cutlass.range_constexpr(CHUNK):
                w = r_kw[i]
                u = r_v[i]
                for j in cutlass.range_constexpr(i):
                    aij = s_akk[i, j]
                    w = w - aij * r_wt[j]
                    u = u - aij * r_ut[j]
                r_wt[i] = w
                r_ut[i] = u
                s_wt[i, d] = (-w).to(BFloat16)
                s_ut[i, d] = u
            # make generic-proxy smem writes visible to wgmma (async proxy)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()

            # ---------- phase 4: state update on tensor cores
            a_st = self._acc_to_a_operand(mma_n128, acc_s, VS, HEAD_DIM)  # bf16(St), K = 128
            for i in cutlass.range_constexpr(cute.size(acc_r)):
                m, j = c16[i]
                acc_r[i] = s_ut[j, vbase + m]
            cute.nvgpu.warpgroup.fence()
            # Rt = ut^T + St (-wt)^T
            mma_n16.set(warpgroup.Field.ACCUMULATE, True)
            for kb in cutlass.range_constexpr(HEAD_DIM // 16):
                cute.gemm(mma_n16, acc_r, a_st[None, None, kb], rB_wt[None, None, kb], acc_r)
            # Ot = St qg^T
            for kb in cutlass.range_constexpr(HEAD_DIM // 16):
                mma_n16.set(warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(mma_n16, acc_o, a_st[None, None, kb], rB_qg[None, None, kb], acc_o)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(0)

            a_rt = self._acc_to_a_operand(mma_n128, acc_r, VS, CHUNK)  # bf16(Rt), K = 16
            # St <- St Diag(a)
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                m, col = c128[i]
                acc_s[i] = acc_s[i] * s_a[col]
            cute.nvgpu.warpgroup.fence()
            # Ot += Rt Z^T
            mma_n16.set(warpgroup.Field.ACCUMULATE, True)
            cute.gemm(mma_n16, acc_o, a_rt[None, None, 0], rB_z[None, None, 0], acc_o)
            # St += Rt kg
            mma_n128.set(warpgroup.Field.ACCUMULATE, True)
            cute.gemm(mma_n128, acc_s, a_rt[None, None, 0], rB_kg[None, None, 0], acc_s)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(0)

            # ---------- outputs of this chunk (rows of this sequence only)
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                m, j = c16[i]
                rr = c * CHUNK + j
                if rr < seqlen:
                    mO[bos + rr, h, vbase + m] = acc_o[i].to(BFloat16)

        # ---------------- final state
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            m, col = c128[i]
            mSf[n, h, vbase + m, col] = acc_s[i]
