"""Every chunk's outputs from the state entering it on tensor cores, sm_90a CuTe DSL: after the
forward state scan, parallel over (chunk slot, head), straight into the tokens' rows.

With S the state entering the slot ([K, V], the scan's), the chunk core's W, U, Qg ([64, 128])
and Aqk ([64, 64], lower-triangular):
  V_new = U - W S,  O = Qg S + Aqk V_new            ([64 tokens, V])
one bf16 pass a product with float32 accumulation (the training path's dense products'
precision), V_new rounded to bf16 on its way to the second product; each warpgroup takes half of
V. S's image written by K row is the N-major image of B = [V, K] (the same bytes), V_new's by
token the N-major image of [V, tokens]. O goes out as bfloat16 to the rows of the tokens the
slot holds (cu_seqlens; rows past a sequence's end and gap slots write nothing, bad boundaries
never an out-of-bounds access).

One CTA of two warpgroups a (slot, head). Inputs: states [slots, H, 128, 128] float32 or bf16
(the training forward's, BF16_STATES; rounded to bf16 for the products either way); the
chunk core's bfloat16 w_img [slots, H, 64 * 128] (W in the scan's operand order,
chunk_io.scan_order_offset), u, qg [slots, H, 64, 128] and attn [slots, H, 64, 64];
cu_seqlens [N + 1] int32. Output: o [T, H, 128] bfloat16.
"""

from __future__ import annotations

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
    stage_pairs,
    stage_rows,
    to_image,
)
from jax_kda.sm90.kernels.varlen import slot_rows
from jax_kda.sm90.kernels.wgmma import bf16_tiled_mma, image_layout, row_piece, view

WGS = NTHREADS // 128
HALF = HEAD_DIM // WGS  # a warpgroup's V columns
LANES = 8  # bf16 elements in 16 bytes: O leaves 16 bytes a store

# The shared images (bf16), 1024-byte aligned: S [128, 128]; W, Qg, V_new [64, 128]; Aqk.
SQUARE_BYTES = HEAD_DIM * HEAD_DIM * 2
CHUNK_BYTES = ROWS * HEAD_DIM * 2
OFF_S = 0
OFF_W = OFF_S + SQUARE_BYTES
OFF_QG = OFF_W + CHUNK_BYTES
OFF_VN = OFF_QG + CHUNK_BYTES
OFF_AT = OFF_VN + CHUNK_BYTES
SHARED_BYTES = OFF_AT + ROWS * ROWS * 2


class ChunkOutputsSm90:
    @cute.jit
    def __call__(
        self,
        states: cute.Tensor,
        w_img: cute.Tensor,
        u: cute.Tensor,
        qg: cute.Tensor,
        attn: cute.Tensor,
        cu_seqlens: cute.Tensor,
        o: cute.Tensor,
        stream: cuda.CUstream,
    ):
        mma = bf16_tiled_mma((ROWS, HALF), warpgroup.OperandSource.SMEM, b_mn_major=True)
        self.kernel(states, w_img, u, qg, attn, cu_seqlens, o, mma).launch(
            grid=[u.shape[0], u.shape[1], 1], block=[NTHREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mS: cute.Tensor,
        mWImg: cute.Tensor,
        mU: cute.Tensor,
        mQg: cute.Tensor,
        mAttn: cute.Tensor,
        mCu: cute.Tensor,
        mO: cute.Tensor,
        mma: cute.TiledMma,
    ):
        tid, _, _ = cute.arch.thread_idx()
        slot, h, _ = cute.arch.block_idx()
        d = tid % 128
        part = tid // 128

        smem = SmemAllocator()
        raw = smem.allocate_tensor(Int32, cute.make_layout(SHARED_BYTES // 4), 1024).iterator
        s_s = view(raw, OFF_S, image_layout(HEAD_DIM, HEAD_DIM))  # [K rows, V], by K row
        s_s_v = view(raw, OFF_S, image_layout(HEAD_DIM, HEAD_DIM, mn_major=True))  # as [V, K]
        s_w = view(raw, OFF_W, image_layout(ROWS, HEAD_DIM))
        s_qg = view(raw, OFF_QG, image_layout(ROWS, HEAD_DIM))
        s_vn = view(raw, OFF_VN, image_layout(ROWS, HEAD_DIM))  # [tokens, V]
        s_vn_v = view(raw, OFF_VN, image_layout(HEAD_DIM, ROWS, mn_major=True))  # as [V, tokens]
        s_at = view(raw, OFF_AT, image_layout(ROWS, ROWS))

        to_image(s_s, mS[slot, h, None, None], tid, HEAD_DIM, HEAD_DIM)
        scan_order_image(s_w, mWImg[slot, h, None], tid)
        to_image(s_qg, mQg[slot, h, None, None], tid, ROWS, HEAD_DIM)
        to_image(s_at, mAttn[slot, h, None, None], tid, ROWS, ROWS)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

        # ---- W S and Qg S, this warpgroup's V columns, issued together
        mma.set(warpgroup.Field.ACCUMULATE, True)
        thr = mma.get_slice(d)
        c_half = thr.partition_C(cute.make_identity_tensor((ROWS, HALF)))
        n0 = part * HALF
        f_s = mma.make_fragment_B(
            thr.partition_B(cute.local_tile(s_s_v, (HALF, HEAD_DIM), (part, 0)))
        )
        f_w = mma.make_fragment_A(thr.partition_A(s_w))
        f_qg = mma.make_fragment_A(thr.partition_A(s_qg))
        f_at = mma.make_fragment_A(thr.partition_A(s_at))
        f_vn = mma.make_fragment_B(
            thr.partition_B(cute.local_tile(s_vn_v, (HALF, ROWS), (part, 0)))
        )
        acc_ws = cute.make_rmem_tensor(mma.partition_shape_C((ROWS, HALF)), Float32)
        acc_o = cute.make_rmem_tensor(mma.partition_shape_C((ROWS, HALF)), Float32)
        acc_ws.fill(0.0)
        acc_o.fill(0.0)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(HEAD_DIM // 16):
            cute.gemm(mma, acc_ws, f_w[None, None, kb], f_s[None, None, kb], acc_ws)
        for kb in cutlass.range_constexpr(HEAD_DIM // 16):
            cute.gemm(mma, acc_o, f_qg[None, None, kb], f_s[None, None, kb], acc_o)
        cute.nvgpu.warpgroup.commit_group()
        # U at this thread's accumulator coordinates loads while the products run
        r_u = cute.make_rmem_tensor(acc_ws.shape, Float32)
        for e in cutlass.range_constexpr(0, cute.size(acc_ws), 2):
            i, n = c_half[e]
            pair = pair_at(mU[slot, h, i, None], n0 + n).load().to(Float32)
            r_u[e] = pair[0]
            r_u[e + 1] = pair[1]
        row0, count = slot_rows(mCu, slot, mO.shape[0], SCAN_CHUNK)
        cute.nvgpu.warpgroup.wait_group(0)
        for e in cutlass.range_constexpr(cute.size(acc_ws)):
            i, n = c_half[e]
            s_vn[i, n0 + n] = (r_u[e] - acc_ws[e]).to(BFloat16)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

        # ---- O += Aqk V_new, then into the tokens' rows
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(ROWS // 16):
            cute.gemm(mma, acc_o, f_at[None, None, kb], f_vn[None, None, kb], acc_o)
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(0)
        # out through a plain staged copy in S's space (S was read before V_new was written):
        # 16 bytes a store, into the rows of the tokens the slot holds (H200: 18.8 / 82.0 us at
        # 2048x12x1 / 8192x16x1 against 22.7 / 88.2 with 4-byte stores of accumulator pairs)
        st_o = stage_rows(raw, OFF_S, HEAD_DIM)
        stage_pairs(acc_o, c_half, st_o, n0)
        cute.arch.sync_threads()
        for p in cutlass.range_constexpr(ROWS * HEAD_DIM // (NTHREADS * LANES)):
            e = (p * NTHREADS + tid) * LANES
            i = e // HEAD_DIM
            if i < count:
                row_piece(mO[row0 + i, h, None], e % HEAD_DIM, LANES).store(
                    row_piece(st_o[i, None], e % HEAD_DIM, LANES).load()
                )
