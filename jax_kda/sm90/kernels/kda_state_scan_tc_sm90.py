"""The chunk-state scan on tensor cores, sm_90a CuTe DSL: the contract and math of
kda_state_scan_sm90.py (read its docstring), with the state's V-slice as the wgmma N.

Per chunk, the state Y [128 K, VS] (VS = 16 or 32 columns of one (head, sequence)) lives in
float32 wgmma accumulators (never rounded between chunks), and two products step it:

  product 1:  acc [64 tokens, VS] = A Y (- P forward)          m64nVS,  K = 128 channels
  product 2:  Y = Diag(a) Y (+ Q reverse) + B^T (-acc)        2 x m64nVS, K = 64 tokens

with A = W, B = Kd forward (acc = -X, X = P - W Y: Y += Kd^T X) and A = Kd, B = W reverse
(acc = X = Kd Y: Y -= W^T X). Both products run as three bf16 products (hi*hi + lo*hi +
hi*lo, about 2^-16 relative, float32 accumulation): A and B^T come as bf16 [hi | lo] images
that the caller split and laid out in shared memory's byte order (state_scan_operands), so
that one bulk copy (TMA) each brings them in, one chunk ahead (two stages, an mbarrier each),
with the addend's V slice (also laid out contiguous by the caller) and the decay; Y and -X are
split into bf16 images in shared memory by the threads that hold them. (cp.async of 16-byte
pieces took 2.5 us a chunk to issue on the H200: too few requests in flight per SM for 64 KiB.)

One warpgroup per CTA, grid (128 / VS, H, N): narrow slices give each (head, sequence) 4 or 8
CTAs, so the SMs fill at small H * N, and each chunk step is a few small products (the SIMT
kernel spends ~4.5 us a step on float32 FMAs, the m64 wgmma kernel ~4.4 us at VS = 64).
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
from jax_kda.sm90.kernels.layout import SCAN_TC_V_SLICES
from jax_kda.sm90.kernels.varlen import scan_slots, step_slot
from jax_kda.sm90.kernels.wgmma import bf16_tiled_mma, gemm_passes, image_k, inter_image_layout

NTHREADS = 128
STAGES = 2


def image_elems(passes: int = 3) -> int:
    """bf16 elements of the A image [64 tokens, hi | lo channels] (or the B^T image [128
    channels, hi | lo tokens]) of one chunk: 16384 (32 KiB) at three passes; at one the values
    alone, [64, 128] (wgmma.image_k)."""
    return SCAN_CHUNK * image_k(HEAD_DIM, passes)


HALF = HEAD_DIM // 2  # product 2 is two m64 products: channels [0, 64) and [64, 128)


def scan_mmas(v_slice: int):
    """The scan's two tiled MMAs for V-slices of v_slice columns: product 1 (acc [64 tokens,
    VS] = A Y) and product 2 (Y [64 channels of a half, VS] += B^T X), B N-major."""
    smem = warpgroup.OperandSource.SMEM
    mma_x = bf16_tiled_mma((SCAN_CHUNK, v_slice), smem, b_mn_major=True)
    mma_y = bf16_tiled_mma((HALF, v_slice), smem, b_mn_major=True, a_mn_major=True)
    return mma_x, mma_y


def accumulate_always(*mmas):
    """Every product of the scan accumulates (onto -P or zero, or the decayed state): set once,
    at the kernel's top level, outside every loop and branch (the field is staged state of the
    TiledMma object: set inside a branch, its value would not reach the other)."""
    for mma in mmas:
        mma.set(warpgroup.Field.ACCUMULATE, True)


class ChunkStateScanTcSm90:
    def __init__(self, config: ScanConfig, passes: int = 3):
        if config.v_slice not in SCAN_TC_V_SLICES:
            raise ValueError(
                f"the tensor-core scan owns {SCAN_TC_V_SLICES} state columns, got {config.v_slice}"
            )
        self.reverse = config.reverse
        self.vs = config.v_slice
        self.addend_rows = config.addend_rows
        self.passes = passes  # bf16 passes a product (wgmma.image_k): 3, or 1 (NOT GPU-run)
        self.a_k = image_k(HEAD_DIM, passes)
        self.bt_k = image_k(SCAN_CHUNK, passes)
        self.image_elems = image_elems(passes)

    @cute.jit
    def __call__(
        self,
        a_img: cute.Tensor,
        bt_img: cute.Tensor,
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
        mma_x, mma_y = scan_mmas(self.vs)
        self.kernel(
            a_img, bt_img, decay, addend, cu_seqlens, y0, states, final, mma_x, mma_y
        ).launch(grid=[HEAD_DIM // self.vs, heads, n_seq], block=[NTHREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mA: cute.Tensor,
        mBt: cute.Tensor,
        mDecay: cute.Tensor,
        mAdd: cute.Tensor,
        mCu: cute.Tensor,
        mY0: cute.Tensor,
        mStates: cute.Tensor,
        mFinal: cute.Tensor,
        mma_x: cute.TiledMma,
        mma_y: cute.TiledMma,
    ):
        vsl, h, n = cute.arch.block_idx()
        accumulate_always(mma_x, mma_y)
        buffers = self.allocate(self.addend_rows)
        self.scan(mA, mBt, mDecay, mAdd, mCu, mY0, mStates, mFinal, mma_x, mma_y, buffers,
                  vsl, h, n)  # fmt: skip

    def allocate(self, addend_rows: int):
        """The kernel's shared memory (addend stages of addend_rows x VS float32: a kernel that
        runs both directions allocates the larger, the reverse's)."""
        smem = SmemAllocator()
        flat = cute.make_layout(self.image_elems)
        raw_a = [smem.allocate_tensor(BFloat16, flat, 1024) for _ in range(STAGES)]
        raw_bt = [smem.allocate_tensor(BFloat16, flat, 1024) for _ in range(STAGES)]
        lay_y = inter_image_layout(self.vs, self.a_k, mn_major=True)  # B of product 1
        lay_x = inter_image_layout(self.vs, self.bt_k, mn_major=True)  # B of product 2
        s_y = smem.allocate_tensor(BFloat16, lay_y.outer, 1024, swizzle=lay_y.inner)
        s_x = smem.allocate_tensor(BFloat16, lay_x.outer, 1024, swizzle=lay_x.inner)
        add_elems = addend_rows * self.vs
        raw_add = [smem.allocate_tensor(Float32, cute.make_layout(add_elems), 128)
                   for _ in range(STAGES)]  # fmt: skip
        s_decay = [smem.allocate_tensor(Float32, cute.make_layout(HEAD_DIM), 128)
                   for _ in range(STAGES)]  # fmt: skip
        s_mbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout(STAGES), 8)
        return raw_a, raw_bt, s_y, s_x, raw_add, s_decay, s_mbar

    @cute.jit
    def scan(self, mA, mBt, mDecay, mAdd, mCu, mY0, mStates, mFinal, mma_x, mma_y, buffers,
             vsl, h, n):  # fmt: skip
        """This direction's scan of (state columns vsl, head h, sequence n) in `buffers`
        (allocate's)."""
        VS = self.vs
        tid, _, _ = cute.arch.thread_idx()
        vbase = vsl * VS
        n_slots = mStates.shape[0]
        raw_a, raw_bt, s_y, s_x, raw_add, s_decay, s_mbar = buffers
        lay_a = inter_image_layout(SCAN_CHUNK, self.a_k)
        lay_bt = inter_image_layout(HEAD_DIM, self.bt_k, mn_major=True)
        s_a = [cute.make_tensor(r.iterator, lay_a) for r in raw_a]
        s_bt = [cute.make_tensor(r.iterator, lay_bt) for r in raw_bt]
        add_layout = cute.make_layout((self.addend_rows, VS), stride=(VS, 1))
        s_add = [cute.make_tensor(r.iterator, add_layout) for r in raw_add]
        if tid == 0:
            for s in cutlass.range_constexpr(STAGES):
                cute.arch.mbarrier_init(s_mbar.iterator + s, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        loads = (raw_a, raw_bt, raw_add, s_decay, s_mbar)

        thr_x = mma_x.get_slice(tid)
        thr_y = mma_y.get_slice(tid)
        f_a = [mma_x.make_fragment_A(thr_x.partition_A(s_a[s])) for s in range(STAGES)]
        f_bt = [[mma_y.make_fragment_A(thr_y.partition_A(
                    cute.local_tile(s_bt[s], (HALF, self.bt_k), (m, 0)))) for m in range(2)]
                for s in range(STAGES)]  # fmt: skip
        f_y = mma_x.make_fragment_B(thr_x.partition_B(s_y))
        f_x = mma_y.make_fragment_B(thr_y.partition_B(s_x))
        c_x = thr_x.partition_C(cute.make_identity_tensor((SCAN_CHUNK, VS)))  # (token, v)
        c_y = thr_y.partition_C(cute.make_identity_tensor((HALF, VS)))  # (channel % 64, v)
        acc_x = cute.make_rmem_tensor(mma_x.partition_shape_C((SCAN_CHUNK, VS)), Float32)
        acc_y = [cute.make_rmem_tensor(mma_y.partition_shape_C((HALF, VS)), Float32)
                 for _ in range(2)]  # fmt: skip

        slot0, nch, gap_end = scan_slots(mCu, n, n_slots, SCAN_CHUNK)
        for m in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(cute.size(acc_y[m])):
                ch, v = c_y[i]
                acc_y[m][i] = mY0[n, h, m * HALF + ch, vbase + v]

        if nch > 0 and tid == 0:
            first = step_slot(slot0, nch, self.reverse, 0)
            self._load(mA, mBt, mDecay, mAdd, first, h, vsl, 0, loads)

        for j in cutlass.range(nch, unroll=1):
            slot = step_slot(slot0, nch, self.reverse, j)
            for s in cutlass.range_constexpr(STAGES):
                if j % STAGES == s:
                    if j + 1 < nch and tid == 0:
                        nxt = step_slot(slot0, nch, self.reverse, j + 1)
                        self._load(mA, mBt, mDecay, mAdd, nxt, h, vsl, 1 - s, loads)
                    phase = (j // STAGES) % 2
                    self._step(mma_x, mma_y, acc_x, acc_y, c_x, c_y, f_a[s], f_bt[s], f_y, f_x,
                               s_y, s_x, s_add[s], s_decay[s], s_mbar.iterator + s, phase,
                               mStates, slot, h, vbase)  # fmt: skip

        for m in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(cute.size(acc_y[m])):
                ch, v = c_y[i]
                mFinal[n, h, m * HALF + ch, vbase + v] = acc_y[m][i]
        # gap slots after this sequence's chunks: zero states (coalesced over columns)
        for slot in cutlass.range(slot0 + nch, gap_end, unroll=1):
            for it in cutlass.range_constexpr(HEAD_DIM * VS // NTHREADS):
                e = tid + it * NTHREADS
                mStates[slot, h, e // VS, vbase + e % VS] = Float32(0.0)

    @cute.jit
    def _step(self, mma_x, mma_y, acc_x, acc_y, c_x, c_y, f_a, f_bt, f_y, f_x, s_y, s_x,
              s_add, s_decay, mbar, phase, mStates, slot, h, vbase):  # fmt: skip
        """One chunk: store the state entering it, then the two products."""
        for m in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(cute.size(acc_y[m])):
                ch, v = c_y[i]
                ch = m * HALF + ch
                y = acc_y[m][i]
                mStates[slot, h, ch, vbase + v] = y
                y_hi = y.to(BFloat16)
                s_y[v, ch] = y_hi
                if cutlass.const_expr(self.passes == 3):
                    s_y[v, HEAD_DIM + ch] = (y - y_hi.to(Float32)).to(BFloat16)
        cute.arch.mbarrier_wait(mbar, phase)  # the chunk's copies landed
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()  # the chunk's images and Y's visible to every thread

        # Y = Diag(a) Y (+ Q reverse), before product 1 is issued: registers that an issued
        # wgmma may still read (any accumulator, for the compiler) make it wait for the product.
        for m in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(cute.size(acc_y[m])):
                ch, v = c_y[i]
                ch = m * HALF + ch
                y = acc_y[m][i] * s_decay[ch]
                if cutlass.const_expr(self.reverse):
                    y = y + s_add[ch, v]
                acc_y[m][i] = y

        # ---- product 1: acc = A Y (- P forward)
        for i in cutlass.range_constexpr(cute.size(acc_x)):
            acc_x[i] = Float32(0.0)
            if cutlass.const_expr(not self.reverse):
                tok, v = c_x[i]
                acc_x[i] = -s_add[tok, v]
        cute.nvgpu.warpgroup.fence()
        gemm_passes(mma_x, acc_x, f_a, f_y, HEAD_DIM // 16, self.passes)
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(0)

        # ---- product 2: Y += B^T (-acc): forward acc = -X (Y += Kd^T X), reverse acc = X
        # (Y -= W^T X)
        for i in cutlass.range_constexpr(cute.size(acc_x)):
            tok, v = c_x[i]
            x = -acc_x[i]
            x_hi = x.to(BFloat16)
            s_x[v, tok] = x_hi
            if cutlass.const_expr(self.passes == 3):
                s_x[v, SCAN_CHUNK + tok] = (x - x_hi.to(Float32)).to(BFloat16)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()
        cute.nvgpu.warpgroup.fence()
        for m in cutlass.range_constexpr(2):
            gemm_passes(mma_y, acc_y[m], f_bt[m], f_x, SCAN_CHUNK // 16, self.passes)
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(0)
        cute.arch.sync_threads()  # the stage and the Y, X images free for the next chunk

    @cute.jit
    def _load(self, mA, mBt, mDecay, mAdd, slot, h, vsl, stage: cutlass.Constexpr[int], loads):
        """One thread: one chunk's A and B^T images, addend slice and decay into `stage`, four
        bulk copies completing on the stage's mbarrier."""
        raw_a, raw_bt, raw_add, s_decay, s_mbar = loads
        mbar = s_mbar.iterator + stage
        add_elems = self.addend_rows * self.vs
        nbytes = 2 * self.image_elems * 2 + (add_elems + HEAD_DIM) * 4
        cute.arch.mbarrier_arrive_and_expect_tx(mbar, nbytes)
        pieces = (
            (mA[slot, h, None], raw_a[stage], BFloat16, self.image_elems),
            (mBt[slot, h, None], raw_bt[stage], BFloat16, self.image_elems),
            (mAdd[slot, h, vsl, None], raw_add[stage], Float32, add_elems),
            (mDecay[slot, h, None], s_decay[stage], Float32, HEAD_DIM),
        )
        for src, buf, dtype, elems in pieces:
            dst = cute.make_tensor(buf.iterator, cute.make_layout(elems))  # buf may be larger
            atom = cute.make_copy_atom(
                cpasync.CopyBulkG2SOp(), dtype, num_bits_per_copy=elems * dtype.width
            )
            cute.copy(atom, src, dst, mbar_ptr=mbar)
