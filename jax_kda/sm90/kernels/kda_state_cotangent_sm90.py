"""The outputs' part of each chunk's state cotangent on tensor cores, sm_90a CuTe DSL: the reverse
scan's addend, parallel over (chunk slot, head).

The chunk's outputs O = Qg S + Aqk (U - W S) depend on the state S entering it through
  dL/dS = Qg^T dO - W^T (Aqk^T dO)          ([K, V] = [128, 128])
with dO the outputs' cotangent [64, V]. Two steps, one bf16 pass a product with float32
accumulation (the training path's dense products' precision): X = Aqk^T dO ([64, 128], each
warpgroup half of V, rounded to bf16 on its way to the next product), then Qg^T dO + (-W)^T X,
each warpgroup half of the K channels over all of V (m64n128, K = 64 tokens). Qg and W enter
as A operands M-major: their images written by token ([tokens, channels], K-major) are the
M-major images of [channels, tokens] (the same bytes), as dO's and X's are the N-major images of
B = [V, tokens].

One CTA of two warpgroups a (slot, head). Inputs, the chunk core's bfloat16 arrays: qg [slots,
H, 64, 128], w_img [slots, H, 64 * 128] (W in the scan's operand order,
chunk_io.scan_order_offset), attn [slots, H, 64, 64]; dO [T, H, 128] bfloat16 in the tokens'
rows (cu_seqlens [N + 1] int32 says which a slot holds; the others are zero). Output, float32:
d_states [slots, H, 128, 128], each slot's [K, V] row-major, or (StateCotangentConfig.v_slice =
VS) in the order the tensor-core scan's bulk copies take its addend (kda_state_scan_tc_sm90.py):
V slice by V slice, each [K, VS] row-major, so that no transpose stands between this kernel
and the reverse scan; the sliced form float32 or bf16 (rounded once: half the bytes written
here and read by the scan), as the caller's array is.
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
from jax_kda.sm90.kernels.chunk_io import (
    NTHREADS,
    ROWS,
    pair_at,
    scan_order_image,
    store_pairs,
    to_image,
    token_rows_image,
    transposed_bf16_pairs_image,
)
from jax_kda.sm90.kernels.varlen import slot_rows
from jax_kda.sm90.kernels.wgmma import bf16_tiled_mma, image_layout, view

WGS = NTHREADS // 128
HALF = HEAD_DIM // WGS  # a warpgroup's V columns of X, and K rows of dL/dS

# The shared images (bf16), 1024-byte aligned: Qg, -W, dO, X [64, 128]; Aqk^T [64, 64].
CHUNK_BYTES = ROWS * HEAD_DIM * 2
OFF_QG = 0
OFF_W = OFF_QG + CHUNK_BYTES
OFF_DO = OFF_W + CHUNK_BYTES
OFF_X = OFF_DO + CHUNK_BYTES
OFF_AT = OFF_X + CHUNK_BYTES
SHARED_BYTES = OFF_AT + ROWS * ROWS * 2


@dataclasses.dataclass(frozen=True)
class StateCotangentConfig:
    v_slice: int = 0  # 0: [K, V] row-major; else the tensor-core scan's V slices of this width


class StateCotangentSm90:
    def __init__(self, config: StateCotangentConfig = StateCotangentConfig()):
        if config.v_slice and (config.v_slice % 2 or HEAD_DIM % config.v_slice):
            raise ValueError(f"v_slice divides {HEAD_DIM} and is even, not {config.v_slice}")
        self.v_slice = config.v_slice

    @cute.jit
    def __call__(
        self,
        qg: cute.Tensor,
        w_img: cute.Tensor,
        attn: cute.Tensor,
        d_out: cute.Tensor,
        cu_seqlens: cute.Tensor,
        d_states: cute.Tensor,
        stream: cuda.CUstream,
    ):
        smem = warpgroup.OperandSource.SMEM
        mma_x = bf16_tiled_mma((ROWS, HALF), smem, b_mn_major=True)  # X: N = V
        mma_s = bf16_tiled_mma((HALF, HEAD_DIM), smem, b_mn_major=True, a_mn_major=True)
        self.kernel(qg, w_img, attn, d_out, cu_seqlens, d_states, mma_x, mma_s).launch(
            grid=[qg.shape[0], qg.shape[1], 1], block=[NTHREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mQg: cute.Tensor,
        mWImg: cute.Tensor,
        mAttn: cute.Tensor,
        mDo: cute.Tensor,
        mCu: cute.Tensor,
        mDs: cute.Tensor,
        mma_x: cute.TiledMma,
        mma_s: cute.TiledMma,
    ):
        tid, _, _ = cute.arch.thread_idx()
        slot, h, _ = cute.arch.block_idx()
        d = tid % 128
        part = tid // 128

        smem = SmemAllocator()
        raw = smem.allocate_tensor(Int32, cute.make_layout(SHARED_BYTES // 4), 1024).iterator
        by_token = image_layout(ROWS, HEAD_DIM)  # [tokens, channels or V], written by token
        by_channel = image_layout(HEAD_DIM, ROWS, mn_major=True)  # the same bytes, [128, tokens]
        s_qg = view(raw, OFF_QG, by_token)
        s_qg_m = view(raw, OFF_QG, by_channel)
        s_w = view(raw, OFF_W, by_token)
        s_w_m = view(raw, OFF_W, by_channel)
        s_do = view(raw, OFF_DO, by_token)
        s_do_n = view(raw, OFF_DO, by_channel)
        s_x = view(raw, OFF_X, by_token)
        s_x_n = view(raw, OFF_X, by_channel)
        s_at = view(raw, OFF_AT, image_layout(ROWS, ROWS))  # Aqk^T

        to_image(s_qg, mQg[slot, h, None, None], tid, ROWS, HEAD_DIM)
        scan_order_image(s_w, mWImg[slot, h, None], tid, 0, True)
        row0, count = slot_rows(mCu, slot, mDo.shape[0], SCAN_CHUNK)
        token_rows_image(s_do, mDo[None, h, None], row0, count, tid)
        transposed_bf16_pairs_image(s_at, mAttn[slot, h, None, None], tid)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

        # ---- X = Aqk^T dO, this warpgroup's V columns, into its image
        mma_x.set(warpgroup.Field.ACCUMULATE, True)
        thr_x = mma_x.get_slice(d)
        f_at = mma_x.make_fragment_A(thr_x.partition_A(s_at))
        f_dov = mma_x.make_fragment_B(
            thr_x.partition_B(cute.local_tile(s_do_n, (HALF, ROWS), (part, 0)))
        )
        acc_x = cute.make_rmem_tensor(mma_x.partition_shape_C((ROWS, HALF)), Float32)
        acc_x.fill(0.0)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(ROWS // 16):
            cute.gemm(mma_x, acc_x, f_at[None, None, kb], f_dov[None, None, kb], acc_x)
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(0)
        c_x = thr_x.partition_C(cute.make_identity_tensor((ROWS, HALF)))
        n0 = part * HALF
        for e in cutlass.range_constexpr(cute.size(acc_x)):
            i, n = c_x[e]
            s_x[i, n0 + n] = acc_x[e].to(BFloat16)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

        # ---- dL/dS = Qg^T dO + (-W)^T X, this warpgroup's K channels over all of V
        mma_s.set(warpgroup.Field.ACCUMULATE, True)
        thr_s = mma_s.get_slice(d)
        f_qg = mma_s.make_fragment_A(
            thr_s.partition_A(cute.local_tile(s_qg_m, (HALF, ROWS), (part, 0)))
        )
        f_w = mma_s.make_fragment_A(
            thr_s.partition_A(cute.local_tile(s_w_m, (HALF, ROWS), (part, 0)))
        )
        f_do = mma_s.make_fragment_B(thr_s.partition_B(s_do_n))
        f_x = mma_s.make_fragment_B(thr_s.partition_B(s_x_n))
        acc = cute.make_rmem_tensor(mma_s.partition_shape_C((HALF, HEAD_DIM)), Float32)
        acc.fill(0.0)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(ROWS // 16):
            cute.gemm(mma_s, acc, f_qg[None, None, kb], f_do[None, None, kb], acc)
        for kb in cutlass.range_constexpr(ROWS // 16):
            cute.gemm(mma_s, acc, f_w[None, None, kb], f_x[None, None, kb], acc)
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(0)
        c_s = thr_s.partition_C(cute.make_identity_tensor((HALF, HEAD_DIM)))
        if cutlass.const_expr(self.v_slice == 0):
            out = cute.local_tile(mDs[slot, h, None, None], (HALF, HEAD_DIM), (part, 0))
            store_pairs(acc, c_s, out, 0, False)
        else:
            # (k, v) at flat offset (v // VS) K VS + k VS + v % VS of the slot's [K x V] block;
            # a thread's pair v, v + 1 (v even, VS even) stays adjacent
            out = mDs[slot, h, None, None]
            vs = self.v_slice
            pair = cute.make_rmem_tensor((2,), Float32)
            for e in cutlass.range_constexpr(0, cute.size(acc), 2):
                k, v = c_s[e]
                k = k + part * HALF
                flat = (v // vs) * (HEAD_DIM * vs) + k * vs + v % vs
                pair[0] = acc[e]
                pair[1] = acc[e + 1]
                piece = pair_at(out[flat // HEAD_DIM, None], flat % HEAD_DIM)
                if cutlass.const_expr(out.element_type == BFloat16):  # rounded once
                    piece.store(pair.load().to(BFloat16))
                else:
                    piece.store(pair.load())
