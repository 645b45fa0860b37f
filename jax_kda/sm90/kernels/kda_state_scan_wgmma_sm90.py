"""The chunk-state scan of the backward pass on tensor cores, sm_90a CuTe DSL: the same contract
and math as kda_state_scan_sm90.py (read its docstring), per 64 state columns. A profiling
variant (v64): kda_state_scan_tc_sm90.py, the default, is about 3x faster.

Per chunk, with the state held transposed, St = Y^T [64 V-columns, 128 K] in wgmma accumulators
(64 float32 registers a thread, never rounded between chunks):

  product 1:  Xt [64, 64 tokens] = St A^T (- P^T forward)   m64n64,  K = 128
  product 2:  St = Diag(a) St (+ Q^T reverse) - Xt B        m64n128, K = 64 tokens

Both are register-A wgmma: the A operand is the other product's accumulator, split into a
bfloat16 high and low part, and each product runs as hi*hi + lo*hi + hi*lo over bfloat16 images
of A and B^T in shared memory (relative error about 2^-16 per product, float32 accumulation).
Forward Xt comes out as -X^T and reverse as +X^T; product 2 takes -Xt in both, which gives
Y = Diag(a) Y + B^T X (forward) and Y = Diag(a) Y - B^T X + Q (reverse).

Warp-specialised, 256 threads: warpgroup 0 produces (reads chunk j's float32 A and B from global
memory and writes their bf16 hi/lo images, B transposed, while cp.async copies the addend's V
half and the decay into stage j % 2), warpgroup 1 consumes (the two products and the state).
Named barriers FULL[s] (stage s written) and EMPTY[s] (stage s read) pass the stages between them,
so the conversion of chunk j + 1 runs while chunk j is multiplied. Grid (2, H, N): the two V
halves of the state of one (head, sequence) are independent. A first version with one warpgroup
doing both in turn took 7.7 us a chunk on the H200 (2048x12x1: 507 us for both directions,
against the SIMT kernel's 288).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.warpgroup as warpgroup
from cutlass import BFloat16, Float32
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from jax_kda.constants import HEAD_DIM, SCAN_CHUNK
from jax_kda.sm90.kernels.kda_state_scan_sm90 import ScanConfig
from jax_kda.sm90.kernels.layout import SCAN_WGMMA_V_SLICE
from jax_kda.sm90.kernels.varlen import scan_slots, step_slot
from jax_kda.sm90.kernels.wgmma import (
    bf16_tiled_mma,
    gemm_bf16x3,
    image_layout,
    split_a_operands,
    vec4,
)

ADD_ROW = SCAN_WGMMA_V_SLICE + 4  # padded addend rows in shared memory: conflict-free reads
NTHREADS = 256  # warpgroup 0 produces, warpgroup 1 multiplies
WG = 128
FULL = (1, 2)  # named barrier ids per stage (0 is __syncthreads)
EMPTY = (3, 4)
VS = SCAN_WGMMA_V_SLICE  # state columns per CTA: the wgmma M of both products


class ChunkStateScanWgmmaSm90:
    def __init__(self, config: ScanConfig):
        if config.v_slice != VS:
            raise ValueError(f"the tensor-core scan owns {VS} state columns, got {config.v_slice}")
        self.reverse = config.reverse
        self.addend_rows = config.addend_rows

    @cute.jit
    def __call__(
        self,
        a_op: cute.Tensor,
        b_op: cute.Tensor,
        decay: cute.Tensor,
        addend: cute.Tensor,
        cu_seqlens: cute.Tensor,
        y0: cute.Tensor,
        states: cute.Tensor,
        final: cute.Tensor,
        stream: cuda.CUstream,
    ):
        n_seq = cu_seqlens.shape[0] - 1
        heads = y0.shape[1]
        mma_x = bf16_tiled_mma((VS, SCAN_CHUNK), warpgroup.OperandSource.RMEM)
        mma_y = bf16_tiled_mma((VS, HEAD_DIM), warpgroup.OperandSource.RMEM)
        self.kernel(a_op, b_op, decay, addend, cu_seqlens, y0, states, final, mma_x, mma_y).launch(
            grid=[HEAD_DIM // VS, heads, n_seq], block=[NTHREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mDecay: cute.Tensor,
        mAdd: cute.Tensor,
        mCu: cute.Tensor,
        mY0: cute.Tensor,
        mStates: cute.Tensor,
        mFinal: cute.Tensor,
        mma_x: cute.TiledMma,
        mma_y: cute.TiledMma,
    ):
        ADD_ROWS = self.addend_rows
        tid, _, _ = cute.arch.thread_idx()
        vsl, h, n = cute.arch.block_idx()
        vbase = vsl * VS
        n_slots = mStates.shape[0]
        wg = cute.arch.make_warp_uniform(tid // WG)
        t = tid % WG

        smem = SmemAllocator()
        lay_a = image_layout(SCAN_CHUNK, 2 * HEAD_DIM)  # A: N = token, K = [hi | lo] channel
        lay_b = image_layout(HEAD_DIM, 2 * SCAN_CHUNK)  # B^T: N = channel, K = [hi | lo] token
        s_a_img = [smem.allocate_tensor(BFloat16, lay_a.outer, 1024, swizzle=lay_a.inner)
                   for _ in range(2)]  # fmt: skip
        s_b_img = [smem.allocate_tensor(BFloat16, lay_b.outer, 1024, swizzle=lay_b.inner)
                   for _ in range(2)]  # fmt: skip
        add_layout = cute.make_layout((ADD_ROWS, VS, 2), stride=(ADD_ROW, 1, ADD_ROWS * ADD_ROW))
        s_add = smem.allocate_tensor(Float32, add_layout, 16)
        s_decay = smem.allocate_tensor(
            Float32, cute.make_layout((HEAD_DIM, 2), stride=(1, HEAD_DIM)), 16
        )

        slot0, nch, gap_end = scan_slots(mCu, n, n_slots, SCAN_CHUNK)

        if wg == 0:
            # ---------------- producer: thread t = channel t of A and B
            for j in cutlass.range(nch, unroll=1):
                slot = step_slot(slot0, nch, self.reverse, j)
                for s in cutlass.range_constexpr(2):
                    if j % 2 == s:
                        if j >= 2:
                            cute.arch.barrier(barrier_id=EMPTY[s], number_of_threads=NTHREADS)
                        self._produce(mA, mB, mDecay, mAdd, slot, h, vbase, s, s_a_img[s],
                                      s_b_img[s], s_add, s_decay, t)  # fmt: skip
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier_arrive(barrier_id=FULL[s], number_of_threads=NTHREADS)
            # gap slots after this sequence's chunks: zero states (coalesced over columns)
            for slot in cutlass.range(slot0 + nch, gap_end, unroll=1):
                for it in cutlass.range_constexpr(HEAD_DIM * VS // WG):
                    e = t + it * WG
                    mStates[slot, h, e // VS, vbase + e % VS] = Float32(0.0)
        else:
            # ---------------- consumer: the state in registers, the two products
            thr_x = mma_x.get_slice(t)
            thr_y = mma_y.get_slice(t)
            rB_a = [mma_x.make_fragment_B(thr_x.partition_B(s_a_img[s])) for s in range(2)]
            rB_b = [mma_y.make_fragment_B(thr_y.partition_B(s_b_img[s])) for s in range(2)]
            c_x = thr_x.partition_C(cute.make_identity_tensor((VS, SCAN_CHUNK)))  # (v, token)
            c_y = thr_y.partition_C(cute.make_identity_tensor((VS, HEAD_DIM)))  # (v, channel)
            acc_x = cute.make_rmem_tensor(mma_x.partition_shape_C((VS, SCAN_CHUNK)), Float32)
            acc_y = cute.make_rmem_tensor(mma_y.partition_shape_C((VS, HEAD_DIM)), Float32)
            # Every product accumulates (onto -P^T, zero, or the decayed state): set once here,
            # outside the loop's branches (the field is staged state of the TiledMma object).
            mma_x.set(warpgroup.Field.ACCUMULATE, True)
            mma_y.set(warpgroup.Field.ACCUMULATE, True)
            for i in cutlass.range_constexpr(cute.size(acc_y)):
                v, kk = c_y[i]
                acc_y[i] = mY0[n, h, kk, vbase + v]

            for j in cutlass.range(nch, unroll=1):
                slot = step_slot(slot0, nch, self.reverse, j)
                for s in cutlass.range_constexpr(2):
                    if j % 2 == s:
                        cute.arch.barrier(barrier_id=FULL[s], number_of_threads=NTHREADS)
                        self._consume(mma_x, mma_y, acc_x, acc_y, c_x, c_y, rB_a[s], rB_b[s],
                                      s_add, s_decay, s, mStates, slot, h, vbase)  # fmt: skip
                        if j + 2 < nch:  # the producer waits for this stage again
                            cute.arch.barrier_arrive(
                                barrier_id=EMPTY[s], number_of_threads=NTHREADS
                            )
            for i in cutlass.range_constexpr(cute.size(acc_y)):
                v, kk = c_y[i]
                mFinal[n, h, kk, vbase + v] = acc_y[i]

    @cute.jit
    def _consume(self, mma_x, mma_y, acc_x, acc_y, c_x, c_y, rB_a, rB_b, s_add, s_decay,
                 stage: cutlass.Constexpr[int], mStates, slot, h, vbase):  # fmt: skip
        """One chunk: store the state entering it, then the two products."""
        for i in cutlass.range_constexpr(cute.size(acc_y)):
            v, kk = c_y[i]
            mStates[slot, h, kk, vbase + v] = acc_y[i]

        # ---- product 1: Xt = St A^T (- P^T forward), K = 128 channels
        y_hi, y_lo = split_a_operands(mma_y, acc_y, VS, HEAD_DIM)
        for i in cutlass.range_constexpr(cute.size(acc_x)):
            acc_x[i] = Float32(0.0)
            if cutlass.const_expr(not self.reverse):
                v, tok = c_x[i]
                acc_x[i] = -s_add[tok, v, stage]
        cute.nvgpu.warpgroup.fence()
        gemm_bf16x3(mma_x, acc_x, y_hi, y_lo, 0, rB_a, HEAD_DIM // 16)
        cute.nvgpu.warpgroup.commit_group()

        # meanwhile: St = Diag(a) St (+ Q^T reverse)
        for i in cutlass.range_constexpr(cute.size(acc_y)):
            v, kk = c_y[i]
            y = acc_y[i] * s_decay[kk, stage]
            if cutlass.const_expr(self.reverse):
                y = y + s_add[kk, v, stage]
            acc_y[i] = y
        cute.nvgpu.warpgroup.wait_group(0)

        # ---- product 2: St += (-Xt) B, K = 64 tokens
        x_hi, x_lo = split_a_operands(mma_x, acc_x, VS, SCAN_CHUNK, negate=True)
        cute.nvgpu.warpgroup.fence()
        gemm_bf16x3(mma_y, acc_y, x_hi, x_lo, 0, rB_b, SCAN_CHUNK // 16)
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(0)

    @cute.jit
    def _produce(self, mA, mB, mDecay, mAdd, slot, h, vbase, stage: cutlass.Constexpr[int],
                 s_a_img, s_b_img, s_add, s_decay, t):  # fmt: skip
        """One chunk's operands into `stage`: the addend's V half and the decay by cp.async
        (issued first, waited for last), A and B^T as bf16 hi/lo images (thread t = channel t)."""
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), Float32, num_bits_per_copy=128
        )
        add_vec_row = VS // 4
        for it in cutlass.range_constexpr(self.addend_rows * add_vec_row // WG):
            e = t + it * WG
            row = e // add_vec_row
            col = (e % add_vec_row) * 4
            src = mAdd[slot, h, row, None].iterator + (vbase + col)
            cute.copy(atom, vec4(src), vec4(s_add[row, None, stage].iterator + col))
        if t < HEAD_DIM // 4:
            src = mDecay[slot, h, None].iterator + 4 * t
            cute.copy(atom, vec4(src), vec4(s_decay[None, stage].iterator + 4 * t))
        cute.arch.cp_async_commit_group()
        # Two halves of 32 tokens, the half a loop variable: its 64 loads are in flight together,
        # and the swizzled store addresses are computed in the loop, not hoisted out of the
        # chunk loop (256 live addresses spilled to local memory when fully unrolled).
        half = SCAN_CHUNK // 2
        for part in cutlass.range(2, unroll=1):
            a_row = cute.make_rmem_tensor((half,), Float32)
            b_row = cute.make_rmem_tensor((half,), Float32)
            for i in cutlass.range_constexpr(half):
                a_row[i] = mA[slot, h, part * half + i, t]
                b_row[i] = mB[slot, h, part * half + i, t]
            for i in cutlass.range_constexpr(half):
                tok = part * half + i
                a = a_row[i]
                a_hi = a.to(BFloat16)
                s_a_img[tok, t] = a_hi
                s_a_img[tok, HEAD_DIM + t] = (a - a_hi.to(Float32)).to(BFloat16)
                b = b_row[i]
                b_hi = b.to(BFloat16)
                s_b_img[t, tok] = b_hi
                s_b_img[t, SCAN_CHUNK + tok] = (b - b_hi.to(Float32)).to(BFloat16)
        cute.arch.cp_async_wait_group(0)
