"""The chunk's dense products' backward on tensor cores, sm_90a CuTe DSL: parallel over (chunk
slot, head), after both state scans. What xla.forward's products around the state scan (V_new =
U - W S, O = Qg S + Aqk V_new) and the scan's own parallel part give back, and the chunk core's
solve backward after them, in one pass over each chunk.

Per slot, with S the state entering it ([K, V], the forward scan's), G the cotangent of the state
leaving it ([K, V], the reverse scan's), dO the outputs' cotangent ([64, V]), T^-1 the chunk
core's inverse and R = [W | U] ([64, 256]):
  V_new = U - W S
  dV = Aqk^T dO + Kd G                       (the cotangent of U)
  dW = -dV S^T, d_qg = dO S^T, d_attn = dO V_new^T, d_kd = V_new G^T
  d_decay = rowsum(S * G)                    (float32, from the loads)
  d_rhs = T^-T [dW | dV]                     ([64, 256])
  d_lower = -strictLower(d_rhs R^T); d_kk = beta_i d_lower; d_beta_kk = rowsum(d_lower * kk)

Products on wgmma, one bf16 pass each (the training path's dense products' precision) except
Kd G, which takes G as hi + lo (two passes: G's rounding alone, with the other operands' one
pass, put dbeta of a 257-token call at 1.1e-2 rms against the float64 oracle on one seed in 24;
with G split, 6.7e-3), float32 accumulation; the [64, 128] results are two m64n64, one a
warpgroup (its half of the columns), d_attn and d_lower two m64n32, d_rhs two m64n128
(warpgroup 0 dW's columns, 1 dV's). An image written K-major as [rows, cols] is also the
N-major image of [cols, rows] (the same bytes): S and G are B N-major for W S and Kd G and B
K-major for the S^T and G^T products; dO is A of dO S^T and dO V_new^T and B N-major of Aqk^T
dO; [dW | dV] is B N-major of T^-T [dW | dV]; R is A of W S (its first 128 columns) and B
K-major of d_rhs R^T. V_new, dV, [dW | dV] and d_rhs go back into shared
memory as bf16 images for the products after them.

One CTA of two warpgroups a (slot, head), 192 KiB of shared memory. Inputs: the chunk core's
bfloat16 w_img, kd_img [slots, H, 64 * 128] (W and Kd in the scan's operand order,
chunk_io.scan_order_offset), u [slots, H, 64, 128], attn, tinv [slots, H, 64, 64]; float32 kk
[slots, H, 64, 64] and g_end [slots, H, 128, 128]; states [slots, H, 128, 128] bf16 (the
training forward's, BF16_STATES: the values its products took) or float32;
and in the tokens' rows (cu_seqlens [N + 1] int32 says which a slot holds; the others are zero)
dO [T, H, 128] bfloat16 and beta [T, H] float32. Outputs: d_rhs [slots, H, 64, 256]; d_qg,
d_kd [slots, H, 64, 128]; d_attn [slots, H, 64, 64], bfloat16 (each float32 result rounded
once: half the bytes written here and read by the decayed and tokens kernels;
benchmarks.precision_study puts the gradients' cost at about 5e-4 of rms_ratio); d_kk [slots,
H, 64, 64] bfloat16 in the exported artifact or float32 (the kernel stores whichever its tensor
holds); d_decay [slots, H, 128] and d_beta_kk [slots, H, 64] float32.

The four bf16 results leave 16 bytes a store: d_qg, d_kd and d_attn from plain staged rows in
shared memory (where G, dO, V_new and dV were) while the d_rhs product runs, d_rhs from its own
operand image while the d_lower product runs (H200, benchmarks.kernel_profile: 52.2 / 264.7
us at 2048x12x1 / 8192x16x1 against 65.6 / 309.3 with 4-byte stores of accumulator pairs,
where Nsight Compute put about a third of the kernel's stall samples on those stores). The
decayed and state-cotangent kernels took the same staging and got slower (one CTA an SM there,
or little to store), so they keep their pair stores. Once its operands are in their images, a
CTA asks L2 for kk, which only d_lower's epilogue reads (prefetch.py): 56.4-56.5 -> 53.7-54.0
us at 2048x12x1 and 281.7-282.1 -> 264.7-266.9 at 8192x16x1 (H100, 2026-12-07,
results/2026-12-07-h100-h-*; the training step's every result bit for bit as before).
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
    pair_at,
    scan_order_image,
    stage_pairs,
    stage_rows,
    to_image,
    token_rows_image,
    transposed_bf16_pairs_image,
)
from jax_kda.sm90.kernels.prefetch import prefetch_rows
from jax_kda.sm90.kernels.varlen import slot_rows
from jax_kda.sm90.kernels.wgmma import (
    bf16_tiled_mma,
    image_layout,
    row_piece,
    store_piece,
    vec4,
    view,
)

ROWS = SCAN_CHUNK
WGS = 2  # warpgroups; each takes half of every product's columns
HALF_N = HEAD_DIM // WGS
HALF_T = ROWS // WGS  # a warpgroup's token columns of d_attn and d_lower
LANES = 8  # bf16 elements in 16 bytes: the outputs leave 16 bytes a store

# The shared images (bf16), in order, 1024-byte aligned: S and G [128, 128] (then d_rhs
# [64, 256] over S); dO, V_new, Kd (then dV) [64, 128]; Aqk^T, T^-T [64, 64]; R = [W | U] and
# G's low part [128, 128] (then [dW | dV] [64, 256]). Once the products that read them are
# done, the results' stages (padded bf16 rows, chunk_io.stage_rows) take G's space (d_qg), dO's
# and the start of V_new's (d_kd: 17 of the 32 KiB) and Kd's (d_attn).
SQUARE_BYTES = HEAD_DIM * HEAD_DIM * 2
CHUNK_BYTES = ROWS * HEAD_DIM * 2
PAIRS_BYTES = ROWS * ROWS * 2
WIDE = 2 * HEAD_DIM  # R's and d_rhs's columns
OFF_S = 0
OFF_G = OFF_S + SQUARE_BYTES
OFF_DO = OFF_G + SQUARE_BYTES
OFF_VN = OFF_DO + CHUNK_BYTES
OFF_KD = OFF_VN + CHUNK_BYTES
OFF_AT = OFF_KD + CHUNK_BYTES
OFF_TT = OFF_AT + PAIRS_BYTES
OFF_R = OFF_TT + PAIRS_BYTES
OFF_DS = OFF_R + 2 * CHUNK_BYTES
SHARED_BYTES = OFF_DS + 2 * CHUNK_BYTES


class DenseBwdSm90:
    @cute.jit
    def __call__(
        self,
        w_img: cute.Tensor,
        u: cute.Tensor,
        attn: cute.Tensor,
        kd_img: cute.Tensor,
        states: cute.Tensor,
        g_end: cute.Tensor,
        d_out: cute.Tensor,
        tinv: cute.Tensor,
        kk: cute.Tensor,
        beta: cute.Tensor,
        cu_seqlens: cute.Tensor,
        d_rhs: cute.Tensor,
        d_qg: cute.Tensor,
        d_attn: cute.Tensor,
        d_kd: cute.Tensor,
        d_decay: cute.Tensor,
        d_kk: cute.Tensor,
        d_beta_kk: cute.Tensor,
        stream: cuda.CUstream,
    ):
        for out in (d_rhs, d_qg, d_attn, d_kd):
            if cutlass.const_expr(out.element_type != BFloat16):
                raise TypeError(
                    "d_rhs, d_qg, d_attn and d_kd are bfloat16 (they leave 16 bytes a store)"
                )
        n_slots = u.shape[0]
        heads = u.shape[1]
        smem = warpgroup.OperandSource.SMEM
        mma_n = bf16_tiled_mma((ROWS, HALF_N), smem, b_mn_major=True)  # N = V
        mma_k = bf16_tiled_mma((ROWS, HALF_N), smem)  # N = K (the transposed products)
        mma_t = bf16_tiled_mma((ROWS, HALF_T), smem)  # d_attn, d_lower: N = tokens
        mma_r = bf16_tiled_mma((ROWS, HEAD_DIM), smem, b_mn_major=True)  # d_rhs: N = R's columns
        self.kernel(
            w_img, u, attn, kd_img, states, g_end, d_out, tinv, kk, beta, cu_seqlens, d_rhs, d_qg,
            d_attn, d_kd, d_decay, d_kk, d_beta_kk, mma_n, mma_k, mma_t, mma_r,
        ).launch(grid=[n_slots, heads, 1], block=[NTHREADS, 1, 1], stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mWImg: cute.Tensor,
        mU: cute.Tensor,
        mAttn: cute.Tensor,
        mKdImg: cute.Tensor,
        mS: cute.Tensor,
        mG: cute.Tensor,
        mDo: cute.Tensor,
        mTinv: cute.Tensor,
        mKK: cute.Tensor,
        mBeta: cute.Tensor,
        mCu: cute.Tensor,
        mDrhs: cute.Tensor,
        mDqg: cute.Tensor,
        mDattn: cute.Tensor,
        mDkd: cute.Tensor,
        mDdecay: cute.Tensor,
        mDkk: cute.Tensor,
        mDbeta: cute.Tensor,
        mma_n: cute.TiledMma,
        mma_k: cute.TiledMma,
        mma_t: cute.TiledMma,
        mma_r: cute.TiledMma,
    ):
        tid, _, _ = cute.arch.thread_idx()
        slot, h, _ = cute.arch.block_idx()
        d = tid % 128  # the thread within its warpgroup
        part = tid // 128  # warpgroup: columns [HALF_N part, HALF_N (part + 1)) of a product

        smem = SmemAllocator()
        s_raw = smem.allocate_tensor(Int32, cute.make_layout(SHARED_BYTES // 4), 1024)
        s_beta = smem.allocate_tensor(Float32, cute.make_layout(ROWS), 16)
        s_db = smem.allocate_tensor(Float32, cute.make_layout((ROWS, WGS)), 16)
        raw = s_raw.iterator
        by_k = image_layout(HEAD_DIM, HEAD_DIM)  # [K rows, V]: B of the S^T / G^T products
        by_v = image_layout(HEAD_DIM, HEAD_DIM, mn_major=True)  # the same bytes as [V, K]
        s_s = view(raw, OFF_S, by_k)
        s_s_v = view(raw, OFF_S, by_v)
        s_g = view(raw, OFF_G, by_k)
        s_g_v = view(raw, OFF_G, by_v)
        s_do = view(raw, OFF_DO, image_layout(ROWS, HEAD_DIM))  # [tokens, V]
        s_do_v = view(raw, OFF_DO, image_layout(HEAD_DIM, ROWS, mn_major=True))  # as [V, tokens]
        s_vn = view(raw, OFF_VN, image_layout(ROWS, HEAD_DIM))
        s_kd = view(raw, OFF_KD, image_layout(ROWS, HEAD_DIM))
        s_dv = s_kd  # dV once Kd G is done
        s_at = view(raw, OFF_AT, image_layout(ROWS, ROWS))  # Aqk^T
        s_tt = view(raw, OFF_TT, image_layout(ROWS, ROWS))  # T^-T
        s_r = view(raw, OFF_R, image_layout(ROWS, WIDE))  # [W | U]
        s_ds = view(raw, OFF_DS, image_layout(ROWS, WIDE))  # [dW | dV]
        s_ds_n = view(raw, OFF_DS, image_layout(WIDE, ROWS, mn_major=True))  # as [256, tokens]
        s_glo_v = view(raw, OFF_DS, by_v)  # G's low part until [dW | dV] is written there
        s_rhs = view(raw, OFF_S, image_layout(ROWS, WIDE))  # d_rhs, once S is read
        # plain bf16 rows for d_qg, d_kd and d_attn on their way out, once the products that
        # read G, dO, V_new and dV are done (d_kd's stage runs 1008 bytes into V_new's image)
        st_qg = stage_rows(raw, OFF_G, HEAD_DIM)
        st_kd = stage_rows(raw, OFF_DO, HEAD_DIM)
        st_at = stage_rows(raw, OFF_KD, ROWS)

        # ---- the operands into their images; d_decay from S and G as they pass
        _square_images(s_s, s_g, view(raw, OFF_DS, by_k), mS[slot, h, None, None],
                       mG[slot, h, None, None], mDdecay[slot, h, None], tid)  # fmt: skip
        scan_order_image(s_r, mWImg[slot, h, None], tid, 0)
        to_image(s_r, mU[slot, h, None, None], tid, ROWS, HEAD_DIM, HEAD_DIM)
        scan_order_image(s_kd, mKdImg[slot, h, None], tid, 0)
        row0, count = slot_rows(mCu, slot, mDo.shape[0], SCAN_CHUNK)
        token_rows_image(s_do, mDo[None, h, None], row0, count, tid)
        transposed_bf16_pairs_image(s_at, mAttn[slot, h, None, None], tid)
        transposed_bf16_pairs_image(s_tt, mTinv[slot, h, None, None], tid)
        if tid < ROWS:
            b = Float32(0.0)
            if tid < count:
                b = mBeta[row0 + tid, h]
            s_beta[tid] = b
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()
        # kk, read only by d_lower's epilogue, into L2 (prefetch.py) while the products run
        kk_bytes = ROWS * mKK.element_type.width // 8
        prefetch_rows(((mKK[slot, h, None, None], 0, kk_bytes),), 0, ROWS, tid, NTHREADS)

        mma_n.set(warpgroup.Field.ACCUMULATE, True)
        mma_k.set(warpgroup.Field.ACCUMULATE, True)
        mma_t.set(warpgroup.Field.ACCUMULATE, True)
        mma_r.set(warpgroup.Field.ACCUMULATE, True)
        thr_n = mma_n.get_slice(d)
        thr_k = mma_k.get_slice(d)
        thr_t = mma_t.get_slice(d)
        thr_r = mma_r.get_slice(d)
        c_half = thr_n.partition_C(cute.make_identity_tensor((ROWS, HALF_N)))
        c_t = thr_t.partition_C(cute.make_identity_tensor((ROWS, HALF_T)))
        c_r = thr_r.partition_C(cute.make_identity_tensor((ROWS, HEAD_DIM)))
        n0 = part * HALF_N

        # ---- W S and Aqk^T dO + Kd G (this warpgroup's V columns), issued together
        f_sv = mma_n.make_fragment_B(
            thr_n.partition_B(cute.local_tile(s_s_v, (HALF_N, HEAD_DIM), (part, 0)))
        )
        f_gv = mma_n.make_fragment_B(
            thr_n.partition_B(cute.local_tile(s_g_v, (HALF_N, HEAD_DIM), (part, 0)))
        )
        f_glo = mma_n.make_fragment_B(
            thr_n.partition_B(cute.local_tile(s_glo_v, (HALF_N, HEAD_DIM), (part, 0)))
        )
        f_dov = mma_n.make_fragment_B(
            thr_n.partition_B(cute.local_tile(s_do_v, (HALF_N, ROWS), (part, 0)))
        )
        f_r = mma_n.make_fragment_A(thr_n.partition_A(s_r))  # K-blocks [0, 8): W
        f_kd = mma_n.make_fragment_A(thr_n.partition_A(s_kd))
        f_at = mma_n.make_fragment_A(thr_n.partition_A(s_at))
        acc_ws = cute.make_rmem_tensor(mma_n.partition_shape_C((ROWS, HALF_N)), Float32)
        acc_dv = cute.make_rmem_tensor(mma_n.partition_shape_C((ROWS, HALF_N)), Float32)
        acc_ws.fill(0.0)
        acc_dv.fill(0.0)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(HEAD_DIM // 16):
            cute.gemm(mma_n, acc_ws, f_r[None, None, kb], f_sv[None, None, kb], acc_ws)
        for kb in cutlass.range_constexpr(ROWS // 16):
            cute.gemm(mma_n, acc_dv, f_at[None, None, kb], f_dov[None, None, kb], acc_dv)
        for kb in cutlass.range_constexpr(HEAD_DIM // 16):
            cute.gemm(mma_n, acc_dv, f_kd[None, None, kb], f_gv[None, None, kb], acc_dv)
        for kb in cutlass.range_constexpr(HEAD_DIM // 16):
            cute.gemm(mma_n, acc_dv, f_kd[None, None, kb], f_glo[None, None, kb], acc_dv)
        cute.nvgpu.warpgroup.commit_group()
        # U's values at this thread's accumulator coordinates load while the products run
        r_u = cute.make_rmem_tensor(acc_ws.shape, Float32)
        for e in cutlass.range_constexpr(0, cute.size(acc_ws), 2):
            i, n = c_half[e]
            pair = pair_at(mU[slot, h, i, None], n0 + n).load().to(Float32)
            r_u[e] = pair[0]
            r_u[e + 1] = pair[1]
        cute.nvgpu.warpgroup.wait_group(0)
        cute.arch.sync_threads()  # both warpgroups are done with Kd and G's low part: dV there
        # a thread holds columns n, n + 1 at e, e + 1: 4-byte stores of bf16 pairs
        two = cute.make_rmem_tensor((2,), Float32)
        for e in cutlass.range_constexpr(0, cute.size(acc_ws), 2):
            i, n = c_half[e]
            two[0] = r_u[e] - acc_ws[e]
            two[1] = r_u[e + 1] - acc_ws[e + 1]
            store_piece(s_vn, i, n0 + n, two.load().to(BFloat16), False)
            two[0] = acc_dv[e]
            two[1] = acc_dv[e + 1]
            dv = two.load().to(BFloat16)
            store_piece(s_dv, i, n0 + n, dv, False)
            store_piece(s_ds, i, HEAD_DIM + n0 + n, dv, False)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

        # ---- dV S^T, dO S^T, V_new G^T (this warpgroup's K channels), dO V_new^T (its tokens)
        f_sk = mma_k.make_fragment_B(
            thr_k.partition_B(cute.local_tile(s_s, (HALF_N, HEAD_DIM), (part, 0)))
        )
        f_gk = mma_k.make_fragment_B(
            thr_k.partition_B(cute.local_tile(s_g, (HALF_N, HEAD_DIM), (part, 0)))
        )
        f_dv = mma_k.make_fragment_A(thr_k.partition_A(s_dv))
        f_do = mma_k.make_fragment_A(thr_k.partition_A(s_do))
        f_vn = mma_k.make_fragment_A(thr_k.partition_A(s_vn))
        f_do_t = mma_t.make_fragment_A(thr_t.partition_A(s_do))
        f_vn_t = mma_t.make_fragment_B(
            thr_t.partition_B(cute.local_tile(s_vn, (HALF_T, HEAD_DIM), (part, 0)))
        )
        acc_w = cute.make_rmem_tensor(mma_k.partition_shape_C((ROWS, HALF_N)), Float32)
        acc_q = cute.make_rmem_tensor(mma_k.partition_shape_C((ROWS, HALF_N)), Float32)
        acc_kd = cute.make_rmem_tensor(mma_k.partition_shape_C((ROWS, HALF_N)), Float32)
        acc_at = cute.make_rmem_tensor(mma_t.partition_shape_C((ROWS, HALF_T)), Float32)
        acc_w.fill(0.0)
        acc_q.fill(0.0)
        acc_kd.fill(0.0)
        acc_at.fill(0.0)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(HEAD_DIM // 16):
            cute.gemm(mma_k, acc_w, f_dv[None, None, kb], f_sk[None, None, kb], acc_w)
        for kb in cutlass.range_constexpr(HEAD_DIM // 16):
            cute.gemm(mma_k, acc_q, f_do[None, None, kb], f_sk[None, None, kb], acc_q)
        cute.nvgpu.warpgroup.commit_group()
        for kb in cutlass.range_constexpr(HEAD_DIM // 16):
            cute.gemm(mma_k, acc_kd, f_vn[None, None, kb], f_gk[None, None, kb], acc_kd)
        for kb in cutlass.range_constexpr(HEAD_DIM // 16):
            cute.gemm(mma_t, acc_at, f_do_t[None, None, kb], f_vn_t[None, None, kb], acc_at)
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(1)
        for e in cutlass.range_constexpr(0, cute.size(acc_w), 2):
            i, n = c_half[e]
            two[0] = -acc_w[e]
            two[1] = -acc_w[e + 1]
            store_piece(s_ds, i, n0 + n, two.load().to(BFloat16), False)
        cute.nvgpu.warpgroup.wait_group(0)
        cute.arch.sync_threads()  # every product above is done: G, dO, V_new and dV's space free
        stage_pairs(acc_q, c_half, st_qg, n0)
        stage_pairs(acc_kd, c_half, st_kd, n0)
        stage_pairs(acc_at, c_t, st_at, part * HALF_T)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()  # [dW | dV] written and the stages full; S's space takes d_rhs

        # ---- d_rhs = T^-T [dW | dV]: warpgroup 0 dW's columns, 1 dV's
        f_tt = mma_r.make_fragment_A(thr_r.partition_A(s_tt))
        f_ds = mma_r.make_fragment_B(
            thr_r.partition_B(cute.local_tile(s_ds_n, (HEAD_DIM, ROWS), (part, 0)))
        )
        acc_rhs = cute.make_rmem_tensor(mma_r.partition_shape_C((ROWS, HEAD_DIM)), Float32)
        acc_rhs.fill(0.0)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(ROWS // 16):
            cute.gemm(mma_r, acc_rhs, f_tt[None, None, kb], f_ds[None, None, kb], acc_rhs)
        cute.nvgpu.warpgroup.commit_group()
        # d_qg, d_kd and d_attn leave from their stages while the product runs
        _unstage(st_qg, mDqg[slot, h, None, None], tid)
        _unstage(st_kd, mDkd[slot, h, None, None], tid)
        _unstage(st_at, mDattn[slot, h, None, None], tid)
        cute.nvgpu.warpgroup.wait_group(0)
        r0 = part * HEAD_DIM
        for e in cutlass.range_constexpr(0, cute.size(acc_rhs), 2):
            i, n = c_r[e]
            two[0] = acc_rhs[e]
            two[1] = acc_rhs[e + 1]
            store_piece(s_rhs, i, r0 + n, two.load().to(BFloat16), False)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

        # ---- d_lower = -strictLower(d_rhs R^T) (this warpgroup's tokens j): d_kk, d_beta_kk
        f_rhs = mma_t.make_fragment_A(thr_t.partition_A(s_rhs))
        f_rt = mma_t.make_fragment_B(
            thr_t.partition_B(cute.local_tile(s_r, (HALF_T, WIDE), (part, 0)))
        )
        acc_low = cute.make_rmem_tensor(mma_t.partition_shape_C((ROWS, HALF_T)), Float32)
        acc_low.fill(0.0)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(WIDE // 16):
            cute.gemm(mma_t, acc_low, f_rhs[None, None, kb], f_rt[None, None, kb], acc_low)
        cute.nvgpu.warpgroup.commit_group()
        # d_rhs leaves from its image while the product reads it
        for p in cutlass.range_constexpr(ROWS * WIDE // (NTHREADS * LANES)):
            e = (p * NTHREADS + tid) * LANES
            piece = cute.make_rmem_tensor((LANES,), BFloat16)
            cute.autovec_copy(
                cute.local_tile(s_rhs, (1, LANES), (e // WIDE, (e % WIDE) // LANES))[0, None],
                piece,
            )
            row_piece(mDrhs[slot, h, e // WIDE, None], e % WIDE, LANES).store(piece.load())
        cute.nvgpu.warpgroup.wait_group(0)
        # A thread's accumulator holds two rows (row_a, row_a + 8), each with three more lanes
        # of its quad: its d_beta_kk sums reduce over the quad, then over the warpgroups.
        j0 = part * HALF_T
        row_a = c_t[0][0]
        sum_a = Float32(0.0)
        sum_b = Float32(0.0)
        pair = cute.make_rmem_tensor((2,), Float32)
        for e in cutlass.range_constexpr(0, cute.size(acc_low), 2):
            i, n = c_t[e]
            kk_pair = pair_at(mKK[slot, h, i, None], j0 + n).load()
            for x in cutlass.range_constexpr(2):
                j = j0 + n + x
                kk_ij = Float32(kk_pair[x])  # taken out of the vector before any branch
                low = Float32(0.0)
                if j < i:
                    low = -acc_low[e + x]
                pair[x] = s_beta[i] * low
                if i == row_a:
                    sum_a = sum_a + low * kk_ij
                else:
                    sum_b = sum_b + low * kk_ij
            pair_at(mDkk[slot, h, i, None], j0 + n).store(pair.load().to(mDkk.element_type))
        for offset in cutlass.range_constexpr(2):
            sum_a = sum_a + cute.arch.shuffle_sync_bfly(sum_a, 1 << offset)
            sum_b = sum_b + cute.arch.shuffle_sync_bfly(sum_b, 1 << offset)
        if d % 4 == 0:
            s_db[row_a, part] = sum_a
            s_db[row_a + 8, part] = sum_b
        cute.arch.sync_threads()
        if tid < ROWS:
            mDbeta[slot, h, tid] = s_db[tid, 0] + s_db[tid, 1]


@cute.jit
def _square_images(s_s, s_g, s_glo, m_s: cute.Tensor, m_g: cute.Tensor, m_decay: cute.Tensor,
                   tid):  # fmt: skip
    """S ([128, 128] row-major, float32 or bf16: the forward scan's chunk states as it stored
    them) and G ([128, 128] float32, row-major) into their bf16 images, G's low part (G -
    bf16(G), rounded) into s_glo, and m_decay[k] = the float32 sum over v of S[k, v] G[k, v].
    A warp reads one row of each a pass, 16 bytes a lane of G (8 of a bf16 S), and sums its
    row by shuffles."""
    lane = tid % 32
    passes = HEAD_DIM * HEAD_DIM // (NTHREADS * 4)
    s_type = m_s.element_type
    r_s = cute.make_rmem_tensor((passes, 4), s_type)
    r_g = cute.make_rmem_tensor((passes, 4), Float32)
    for p in cutlass.range_constexpr(passes):
        e = (p * NTHREADS + tid) * 4
        row = e // HEAD_DIM
        col = e % HEAD_DIM
        if cutlass.const_expr(s_type == BFloat16):  # 4 bf16: one 8-byte vector
            s_row = m_s[row, None]
            r_s[p, None].store(
                cute.make_tensor((s_row.iterator + col).align(8), cute.make_layout(4)).load()
            )
        else:
            r_s[p, None].store(vec4(m_s[row, None].iterator + col).load())
        r_g[p, None].store(vec4(m_g[row, None].iterator + col).load())
    for p in cutlass.range_constexpr(passes):
        e = (p * NTHREADS + tid) * 4
        row = e // HEAD_DIM
        col = e % HEAD_DIM
        g_hi = r_g[p, None].load().to(BFloat16)
        if cutlass.const_expr(s_type == BFloat16):
            store_piece(s_s, row, col, r_s[p, None].load(), False)
        else:
            store_piece(s_s, row, col, r_s[p, None].load().to(BFloat16), False)
        store_piece(s_g, row, col, g_hi, False)
        store_piece(s_glo, row, col, (r_g[p, None].load() - g_hi.to(Float32)).to(BFloat16), False)
        dot = Float32(0.0)
        for x in cutlass.range_constexpr(4):
            dot = dot + r_s[p, x].to(Float32) * r_g[p, x]
        for offset in cutlass.range_constexpr(5):
            dot = dot + cute.arch.shuffle_sync_bfly(dot, 16 >> offset)
        if lane == 0:
            m_decay[row] = dot


@cute.jit
def _unstage(stage: cute.Tensor, out: cute.Tensor, tid):
    """A staged [64, cols] bf16 array into out ([64, cols] bf16 in global memory), 16 bytes
    a thread a pass."""
    cols = out.shape[1]
    for p in cutlass.range_constexpr(ROWS * cols // (NTHREADS * LANES)):
        e = (p * NTHREADS + tid) * LANES
        i = e // cols
        row_piece(out[i, None], e % cols, LANES).store(
            row_piece(stage[i, None], e % cols, LANES).load()
        )
