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

One warpgroup per CTA (two in the split kernel below), grid (128 / VS, H, N): narrow slices
give each (head, sequence) 4 or 8 CTAs, so the SMs fill at small H * N, and each chunk step is
a few small products (the SIMT kernel spends ~4.5 us a step on float32 FMAs, the m64 wgmma
kernel ~4.4 us at VS = 64).

With outputs (ChunkStateScanOutputsTcSm90: forward, one bf16 pass), the step also writes the
chunk's outputs for the CTA's V slice, O = Qg S + Aqk X (X = U - W S, the -acc of product 1),
straight into the tokens' rows: both products take operands the step has built anyway (S's image
for product 1, X's for product 2) and the chunk core's Qg [64, 128] and Aqk [64, 64], which the
bulk copies bring in plain beside the chunk's other operands and the threads lay out as images
while product 1 runs. That replaces kda_chunk_outputs_sm90 (its pass over every chunk state,
64 KiB a chunk and head read back from HBM); a call that is not differentiated stores no chunk
states at all (ChunkOutputsScanTcSm90). Shared memory: about 149 KiB at VS = 16, 159 at 32
(one CTA an SM, against two for the scan alone), so the plan fuses only where every CTA has an
SM of its own.

Split (outputs_warpgroup): a second warpgroup of 128 threads takes the outputs, so the chain
does not wait for them: per chunk it brings in Qg and Aqk itself and lays them out, waits for the
chain's S and X images of the chunk (an mbarrier the chain's 128 threads arrive on; both
images a stage each, so the chain writes the next chunk's while these are read), runs the O
products on its own accumulators and stores O; the chain waits for it only before it
overwrites a chunk's images two chunks later. Its copies go two chunks ahead, and it lays chunk
j + 1's Qg and Aqk out into a second image pair while chunk j's products run (before, one pair,
laid out between the products): H100, 2026-12-07 (results/2026-12-07-h100-j-*, against main's
kernels in the same lease, every result of the training step bit for bit), the scan with
outputs 47.1-47.6 -> 39.2-39.4 us at 2048x12x1 and 176.5-176.7 -> 148.0-148.2 at 8192x16x1 in
a training step (its span 304.2-308.9 -> 297.2-300.4 and 1320.8-1334.4 -> 1301.0-1303.1 us);
the no-bound forward, a call of 10 chained, 85.6-87.1 -> 83.0 us at 2048x12x1, 161.2-162.5 ->
152.5 at 4096x12x1, 38.5-39.1 -> 36.3 at 1024x4x1.

Plain addend (the forward scan with outputs always; alone with plain_addend): U comes as the
chunk core stores it, bf16 [slots, H, 64 * 128] row-major, so XLA makes no float32 V-sliced
copy of U (6.0 / 28.3 us at 2048x12x1 / 8192x16x1 on the H200). One TMA copy a chunk (u_tma,
issued beside the stage's other copies by the chain's warp 0) brings the CTA's [64, VS] slice;
it replaced 64 bulk copies of one row each, issued by the chain's four warps in the step's
critical path (the scan alone 30.4 us with the float32 V-sliced U against 43.0 with the row
copies at 2048x12x1, H100, 2026-12-07). With the TMA copy (H200, 2026-12-07, results/
2026-12-07-h200-i-*, against the row copies in the same lease): the scan with outputs 54.2 ->
47.0 us at 2048x12x1 and 211.3 -> 177.3 at 8192x16x1 in a training step; the no-bound forward
96.6 -> 85.7, 416.4 -> 367.7 and 41.9 -> 37.3 us at 2048x12x1, 8192x16x1 and 1024x4x1; the
scan alone on U 28.6 us against 29.7 on XLA's float32 slices; every result bit for bit the row
copies' (a warp issues the TMA copy: cute.copy of a TMA atom elects its lane with elect.sync,
and from thread 0 alone it hung). These variants (plain addend, with
outputs) take y0 and give final in prefill's layout, [N, H, V, K], where the default scans use
[N, H, K, V]: their callers' transposes then cancel against xla.forward's, and the state is not
copied on the way in or out. All three (outputs, split, plain addend) passed their GPU tests
on the H100 (2026-12-06) and are the training forward's defaults.

bf16 chunk states and addend (the training path's, layout.BF16_STATES and BF16_ADDEND): the
dtype of the caller's arrays decides. A forward scan given bf16 states stores each state as
product 1 takes it at one pass (y_hi), a thread's column pair as one 4-byte store; a reverse
scan given a bf16 addend brings its slice in by a bf16 bulk copy into half of the float32
stage. Both equal the float32 kernels bit for bit on the rounded values (H100, 2026-12-07).

Addend warpgroup (addend_warpgroup, ReverseScanAddendTcSm90; off in the training path,
backend.FUSE_ADDEND): the reverse scan forms its addend, the outputs' part of each chunk's state
cotangent, on a second warpgroup a chunk ahead of the chain (_addend_loop) instead of reading
kda_state_cotangent_sm90's; bit for bit that kernel's results on the H100 (2026-12-07), but
no faster: the chain waits on it every step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.warpgroup as warpgroup
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from jax_kda.constants import HEAD_DIM, SCAN_CHUNK
from jax_kda.sm90.kernels.chunk_io import pair_at
from jax_kda.sm90.kernels.kda_state_scan_sm90 import ScanConfig
from jax_kda.sm90.kernels.layout import SCAN_TC_V_SLICES
from jax_kda.sm90.kernels.varlen import scan_slots, sequence_slots, slot_rows, step_slot
from jax_kda.sm90.kernels.wgmma import (
    bf16_tiled_mma,
    gemm_passes,
    image_k,
    inter_image_layout,
    row_piece,
    store_piece,
)

NTHREADS = 128
STAGES = 2


def image_elems(passes: int = 3) -> int:
    """bf16 elements of the A image [64 tokens, hi | lo channels] (or the B^T image [128
    channels, hi | lo tokens]) of one chunk: 16384 (32 KiB) at three passes; at one the values
    alone, [64, 128] (wgmma.image_k)."""
    return SCAN_CHUNK * image_k(HEAD_DIM, passes)


HALF = HEAD_DIM // 2  # product 2 is two m64 products: channels [0, 64) and [64, 128)
CHAIN_BARRIER = 1  # named barriers of the split kernel: the chain's warpgroup,
OUTPUTS_BARRIER = 2  # and the outputs' (0 is the whole CTA's)
X_FULL, O_DONE, QG_FULL = 0, STAGES, 2 * STAGES  # the split kernel's mbarriers, a pair each
ADD_FULL, ADD_FREE, ADD_QG = 0, STAGES, 2 * STAGES  # the addend warpgroup's, a pair each
ADDEND_BARRIER = 3  # the addend warpgroup's named barrier
QG_ELEMS = SCAN_CHUNK * HEAD_DIM  # the outputs' Qg [64, 128] and Aqk [64, 64], bf16
AT_ELEMS = SCAN_CHUNK * SCAN_CHUNK
PIECE = 8  # bf16 elements in 16 bytes


class OutputsStep(NamedTuple):
    """What a step of the scan with outputs needs beyond the scan's own: the O products'
    fragments and accumulator, the Qg and Aqk images and this step's plain stages, o and
    where the sequence's tokens start, and the step's index."""

    f_qg: Any
    f_at: Any
    f_xo: Any
    acc_o: Any
    s_qg: Any
    s_at: Any
    m_o: Any
    bos: Any
    seqlen: Any
    raw_qg: Any = None
    raw_at: Any = None
    j: Any = None


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


def u_slice_layout(v_slice: int) -> cute.Layout:
    """A CTA's slice of U in shared memory: bf16 [64 tokens, VS] dense, rows of 32 or 64 bytes,
    as its TMA copy writes it (the -P reads, 8 rows x 4 column pairs a warp, two- or four-way
    bank conflicted: a few cycles a chunk)."""
    return cute.make_layout((SCAN_CHUNK, v_slice), stride=(v_slice, 1))


def u_tma(u: cute.Tensor, v_slice: int):
    """Host side: the TMA atom and tensor that bring one chunk's [64, VS] slice of U (the chunk
    core's [slots, H, 64 * 128] bf16, row-major) in one copy: U viewed as [slots * H * 64,
    128], tile (slot * H + h, V slice). Rows stay below 2^31 (the plan's 32-bit index guard)."""
    rows = u.shape[0] * u.shape[1] * SCAN_CHUNK
    flat = cute.make_tensor(u.iterator, cute.make_layout((rows, HEAD_DIM), stride=(HEAD_DIM, 1)))
    atom, tensor = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), flat, u_slice_layout(v_slice), (SCAN_CHUNK, v_slice)
    )
    return atom, tensor


def _addend_values(stage: cute.Tensor, per: int) -> cute.Tensor:
    """The addend warpgroup's results in a float32 addend stage: value i (of 2 per, both
    halves' accumulators) of thread t at [i, t], so that a warp's 32 threads touch 32
    consecutive words (the chain's thread t holds the same coordinates as the addend
    warpgroup's thread t: the same tiled MMA)."""
    layout = cute.make_layout((2 * per, NTHREADS), stride=(NTHREADS, 1))
    return cute.make_tensor(stage.iterator, layout)


def _bf16(x) -> bool:
    """Whether an array (a tensor, or None) holds bf16: the chunk states a forward scan stores,
    and a reverse scan's addend, are bf16 or float32 as the caller's arrays are."""
    return x is not None and x.element_type == BFloat16


class ChunkStateScanTcSm90:
    def __init__(
        self, config: ScanConfig, passes: int = 3, outputs: bool = False, states: bool = True,
        plain_addend: bool = False, outputs_warpgroup: bool = False, state_vk: bool = False,
        outputs_images: bool = False, addend_warpgroup: bool = False,
    ):  # fmt: skip
        if config.v_slice not in SCAN_TC_V_SLICES:
            raise ValueError(
                f"the tensor-core scan owns {SCAN_TC_V_SLICES} state columns, got {config.v_slice}"
            )
        if outputs and (config.reverse or passes != 1):
            raise ValueError("the scan writes the outputs forward at one bf16 pass only")
        if not states and not outputs:
            raise ValueError("a scan that stores no states writes the outputs")
        if plain_addend and config.reverse:
            raise ValueError("the forward scan alone takes its addend U plain")
        if outputs_warpgroup and not outputs:
            raise ValueError("a warpgroup of its own for the outputs needs outputs")
        if outputs_images and not outputs_warpgroup:
            raise ValueError("Qg and Aqk as images are a variant of the split kernel")
        if addend_warpgroup and (not config.reverse or passes != 1 or state_vk):
            raise ValueError(
                "the addend's own warpgroup serves the reverse scan at one bf16 pass, [K, V] states"
            )
        # the reverse scan's addend computed in the kernel (ReverseScanAddendTcSm90): a second
        # warpgroup forms each chunk's dL/dS = Qg^T dO - W^T (Aqk^T dO) for the CTA's V slice
        # a chunk ahead of the chain (_addend_loop), in place of kda_state_cotangent_sm90
        self.addend_wg = addend_warpgroup
        # Qg and Aqk come as their K-major operand images (the chunk core's images variant):
        # the outputs' warpgroup copies them into two image stages and lays nothing out
        self.images = outputs_images
        # the O products and stores on a second warpgroup, off the chain (the split kernel)
        self.split = outputs_warpgroup
        self.inline_outputs = outputs and not outputs_warpgroup
        self.threads = NTHREADS * (2 if outputs_warpgroup or addend_warpgroup else 1)
        # the addend U as the chunk core stores it, bf16 [slots, H, 64 * 128] row-major, each CTA
        # bringing its V slice by TMA (with outputs always): no V-sliced float32 copy of U
        self.u_rows = plain_addend or outputs
        # y0 and final in prefill's [N, H, V, K] layout (the default scans': [K, V]), so that
        # the callers' transposes cancel against xla.forward's (the new variants only; the
        # reverse scan beside a plain forward one in BothStateScansSm90 asks for it)
        self.state_vk = plain_addend or outputs or state_vk
        self.outputs = outputs  # ChunkStateScanOutputsTcSm90's: the chunk's O as well
        self.states = states  # False: the chunk states are not stored (mStates is None)
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
        tma_u = None
        if cutlass.const_expr(self.u_rows):  # U plain: its slices by TMA (u_tma)
            tma_u, addend = u_tma(addend, self.vs)
        self.kernel(
            a_img, bt_img, decay, addend, cu_seqlens, y0, states, final, mma_x, mma_y, tma_u
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
        tma_u: cute.CopyAtom | None = None,
    ):
        vsl, h, n = cute.arch.block_idx()
        accumulate_always(mma_x, mma_y)
        buffers = self.allocate(self.addend_rows)
        if cutlass.const_expr(self.u_rows):  # mAdd: U's TMA tensor
            mAdd = (tma_u, mAdd)
        self.scan(mA, mBt, mDecay, mAdd, mCu, mY0, mStates, mFinal, mma_x, mma_y, buffers,
                  vsl, h, n)  # fmt: skip

    def allocate(self, addend_rows: int):
        """The kernel's shared memory (addend stages of addend_rows x VS float32: a kernel that
        runs both directions allocates the larger, the reverse's; with a plain addend U's
        slice, bf16 [64, VS] dense, instead; with outputs the Qg and Aqk stages and images too:
        about 149 KiB at VS = 16, 159 at 32)."""
        smem = SmemAllocator()
        flat = cute.make_layout(self.image_elems)
        raw_a = [smem.allocate_tensor(BFloat16, flat, 1024) for _ in range(STAGES)]
        raw_bt = [smem.allocate_tensor(BFloat16, flat, 1024) for _ in range(STAGES)]
        lay_y = inter_image_layout(self.vs, self.a_k, mn_major=True)  # B of product 1
        lay_x = inter_image_layout(self.vs, self.bt_k, mn_major=True)  # B of product 2
        s_y = smem.allocate_tensor(BFloat16, lay_y.outer, 1024, swizzle=lay_y.inner)
        s_x = smem.allocate_tensor(BFloat16, lay_x.outer, 1024, swizzle=lay_x.inner)
        add_elems = addend_rows * self.vs
        add_type = Float32
        if self.u_rows:  # the CTA's slice of U, bf16 [64, VS] dense, as its TMA copy writes it
            add_elems, add_type = SCAN_CHUNK * self.vs, BFloat16
        raw_add = [smem.allocate_tensor(add_type, cute.make_layout(add_elems), 128)
                   for _ in range(STAGES)]  # fmt: skip
        s_decay = [smem.allocate_tensor(Float32, cute.make_layout(HEAD_DIM), 128)
                   for _ in range(STAGES)]  # fmt: skip
        s_mbar = smem.allocate_tensor(cutlass.Int64, cute.make_layout(STAGES), 8)
        if self.outputs:
            # Qg and Aqk: plain row-major stages (what the bulk copies bring), and their images
            # (with self.images the stages are the images: the copies bring them as they are)
            align = 1024 if self.images else 128
            raw_qg = [smem.allocate_tensor(BFloat16, cute.make_layout(QG_ELEMS), align)
                      for _ in range(STAGES)]  # fmt: skip
            raw_at = [smem.allocate_tensor(BFloat16, cute.make_layout(AT_ELEMS), align)
                      for _ in range(STAGES)]  # fmt: skip
            lay_qg = inter_image_layout(SCAN_CHUNK, HEAD_DIM)
            lay_at = inter_image_layout(SCAN_CHUNK, SCAN_CHUNK)
            if cutlass.const_expr(self.images):
                s_qg = [cute.make_tensor(r.iterator, lay_qg) for r in raw_qg]
                s_at = [cute.make_tensor(r.iterator, lay_at) for r in raw_at]
            elif self.split:  # an image pair a chunk parity: the outputs' warpgroup lays out
                # chunk j + 1's while chunk j's products run (_outputs_loop)
                s_qg = [smem.allocate_tensor(BFloat16, lay_qg.outer, 1024, swizzle=lay_qg.inner)
                        for _ in range(STAGES)]  # fmt: skip
                s_at = [smem.allocate_tensor(BFloat16, lay_at.outer, 1024, swizzle=lay_at.inner)
                        for _ in range(STAGES)]  # fmt: skip
            else:
                s_qg = smem.allocate_tensor(BFloat16, lay_qg.outer, 1024, swizzle=lay_qg.inner)
                s_at = smem.allocate_tensor(BFloat16, lay_at.outer, 1024, swizzle=lay_at.inner)
            split = None
            if self.split:  # S and X images a stage (the outputs' warpgroup reads one while the
                # chain writes the other), and the two warpgroups' mbarriers
                split = (
                    smem.allocate_tensor(BFloat16, lay_y.outer, 1024, swizzle=lay_y.inner),
                    smem.allocate_tensor(BFloat16, lay_x.outer, 1024, swizzle=lay_x.inner),
                    smem.allocate_tensor(cutlass.Int64, cute.make_layout(3 * STAGES), 8),
                )
            images = (raw_qg, raw_at, s_qg, s_at, split)
            return raw_a, raw_bt, s_y, s_x, raw_add, s_decay, s_mbar, images
        if self.addend_wg:
            # the addend warpgroup's: Qg and Aqk plain stages (its own bulk copies) and K-major
            # images, dO's V slice and -X's images (B N-major, as X's), its mbarriers; the
            # addend stages above (128 x VS float32) carry its results to the chain, value i
            # of thread t at [i, t]
            raw_qg = [smem.allocate_tensor(BFloat16, cute.make_layout(QG_ELEMS), 128)
                      for _ in range(STAGES)]  # fmt: skip
            raw_at = [smem.allocate_tensor(BFloat16, cute.make_layout(AT_ELEMS), 128)
                      for _ in range(STAGES)]  # fmt: skip
            addend = (  # the images flat: _addend_loop views them K- and M-major
                raw_qg, raw_at,
                smem.allocate_tensor(BFloat16, cute.make_layout(QG_ELEMS), 1024),
                smem.allocate_tensor(BFloat16, cute.make_layout(AT_ELEMS), 1024),
                smem.allocate_tensor(BFloat16, lay_x.outer, 1024, swizzle=lay_x.inner),
                smem.allocate_tensor(BFloat16, lay_x.outer, 1024, swizzle=lay_x.inner),
                smem.allocate_tensor(cutlass.Int64, cute.make_layout(3 * STAGES), 8),
            )  # fmt: skip
            return raw_a, raw_bt, s_y, s_x, raw_add, s_decay, s_mbar, addend
        return raw_a, raw_bt, s_y, s_x, raw_add, s_decay, s_mbar

    @cute.jit
    def scan(self, mA, mBt, mDecay, mAdd, mCu, mY0, mStates, mFinal, mma_x, mma_y, buffers,
             vsl, h, n, out=()):  # fmt: skip
        """This direction's scan of (state columns vsl, head h, sequence n) in `buffers`
        (allocate's); with outputs, out = (qg, attn, o) (ChunkStateScanOutputsTcSm90's)."""
        VS = self.vs
        tid, _, _ = cute.arch.thread_idx()
        vbase = vsl * VS
        if cutlass.const_expr(self.states):
            n_slots = mStates.shape[0]
        else:
            n_slots = mA.shape[0]
        raw_a, raw_bt, raw_add, s_mbar = buffers[0], buffers[1], buffers[4], buffers[6]
        lay_a = inter_image_layout(SCAN_CHUNK, self.a_k)
        lay_bt = inter_image_layout(HEAD_DIM, self.bt_k, mn_major=True)
        s_a = [cute.make_tensor(r.iterator, lay_a) for r in raw_a]
        s_bt = [cute.make_tensor(r.iterator, lay_bt) for r in raw_bt]
        add_layout = cute.make_layout((self.addend_rows, VS), stride=(VS, 1))
        if cutlass.const_expr(self.u_rows):  # U's slice, bf16 [64, VS] (u_slice_layout)
            add_layout = u_slice_layout(VS)
        add_ptrs = [r.iterator for r in raw_add]
        if cutlass.const_expr(self.u_rows or _bf16(mAdd)):  # bf16, in stages that may be
            add_ptrs = [cute.recast_ptr(p, dtype=BFloat16) for p in add_ptrs]  # typed float32
        s_add = [cute.make_tensor(p, add_layout) for p in add_ptrs]
        if tid == 0:
            for s in cutlass.range_constexpr(STAGES):
                cute.arch.mbarrier_init(s_mbar.iterator + s, 1)
            if cutlass.const_expr(self.split):  # every thread of a warpgroup arrives
                for b in cutlass.range_constexpr(QG_FULL):
                    cute.arch.mbarrier_init(buffers[7][4][2].iterator + b, NTHREADS)
                for b in cutlass.range_constexpr(QG_FULL, QG_FULL + STAGES):  # its own copies
                    cute.arch.mbarrier_init(buffers[7][4][2].iterator + b, 1)
            if cutlass.const_expr(self.addend_wg):  # a warpgroup's threads arrive on the
                for b in cutlass.range_constexpr(ADD_QG):  # full and free pairs
                    cute.arch.mbarrier_init(buffers[7][6].iterator + b, NTHREADS)
                for b in cutlass.range_constexpr(ADD_QG, ADD_QG + STAGES):  # its own copies
                    cute.arch.mbarrier_init(buffers[7][6].iterator + b, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        tiles = (s_a, s_bt, s_add)
        if cutlass.const_expr(self.addend_wg):
            if tid >= NTHREADS:
                self._addend_loop(mCu, n, n_slots, h, vbase, mma_y, buffers, s_bt, out)
            else:
                self._chain(mA, mBt, mDecay, mAdd, mCu, mY0, mStates, mFinal, mma_x, mma_y,
                            buffers, tiles, vsl, h, n, n_slots, out)  # fmt: skip
        elif cutlass.const_expr(self.split):
            if tid >= NTHREADS:
                self._outputs_loop(mCu, n, n_slots, h, vbase, mma_x, buffers, out)
            else:
                self._chain(mA, mBt, mDecay, mAdd, mCu, mY0, mStates, mFinal, mma_x, mma_y,
                            buffers, tiles, vsl, h, n, n_slots, out)  # fmt: skip
        else:
            self._chain(mA, mBt, mDecay, mAdd, mCu, mY0, mStates, mFinal, mma_x, mma_y,
                        buffers, tiles, vsl, h, n, n_slots, out)  # fmt: skip

    @cute.jit
    def _chain(self, mA, mBt, mDecay, mAdd, mCu, mY0, mStates, mFinal, mma_x, mma_y, buffers,
               tiles, vsl, h, n, n_slots, out):  # fmt: skip
        """The serial chain over the chunks of (state columns vsl, head h, sequence n), by the
        first warpgroup: the loads, the two products a step (with outputs inline, the O ones
        after them), the states, the final state."""
        VS = self.vs
        tid, _, _ = cute.arch.thread_idx()
        vbase = vsl * VS
        raw_a, raw_bt, s_y, s_x, raw_add, s_decay, s_mbar = buffers[:7]
        s_a, s_bt, s_add = tiles
        loads = (raw_a, raw_bt, raw_add, s_decay, s_mbar)
        if cutlass.const_expr(self.outputs):
            raw_qg, raw_at, s_qg, s_at, split = buffers[7]
            loads = (*loads, raw_qg, raw_at, out[0], out[1])

        thr_x = mma_x.get_slice(tid)
        thr_y = mma_y.get_slice(tid)
        f_a = [mma_x.make_fragment_A(thr_x.partition_A(s_a[s])) for s in range(STAGES)]
        f_bt = [[mma_y.make_fragment_A(thr_y.partition_A(
                    cute.local_tile(s_bt[s], (HALF, self.bt_k), (m, 0)))) for m in range(2)]
                for s in range(STAGES)]  # fmt: skip
        f_y = mma_x.make_fragment_B(thr_x.partition_B(s_y))
        f_x = mma_y.make_fragment_B(thr_y.partition_B(s_x))
        if cutlass.const_expr(self.split):  # stage s's chunks use image pair s
            ys = (s_y, split[0])
            xs = (s_x, split[1])
            f_ys = (f_y, mma_x.make_fragment_B(thr_x.partition_B(split[0])))
            f_xs = (f_x, mma_y.make_fragment_B(thr_y.partition_B(split[1])))
        c_x = thr_x.partition_C(cute.make_identity_tensor((SCAN_CHUNK, VS)))  # (token, v)
        c_y = thr_y.partition_C(cute.make_identity_tensor((HALF, VS)))  # (channel % 64, v)
        acc_x = cute.make_rmem_tensor(mma_x.partition_shape_C((SCAN_CHUNK, VS)), Float32)
        acc_y = [cute.make_rmem_tensor(mma_y.partition_shape_C((HALF, VS)), Float32)
                 for _ in range(2)]  # fmt: skip

        slot0, nch, gap_end = scan_slots(mCu, n, n_slots, SCAN_CHUNK)
        o_ctx = None
        if cutlass.const_expr(self.inline_outputs):
            # O = Qg S + Aqk X on mma_x: A K-major images [64, 128] and [64, 64], B = S's image
            # (product 1's) and X's (product 2's, its B; K = 64 tokens)
            f_qg = mma_x.make_fragment_A(thr_x.partition_A(s_qg))
            f_at = mma_x.make_fragment_A(thr_x.partition_A(s_at))
            f_xo = mma_x.make_fragment_B(thr_x.partition_B(s_x))
            acc_o = cute.make_rmem_tensor(mma_x.partition_shape_C((SCAN_CHUNK, VS)), Float32)
            bos, seqlen, _, _ = sequence_slots(mCu, n, SCAN_CHUNK)
            o_ctx = OutputsStep(f_qg, f_at, f_xo, acc_o, s_qg, s_at, out[2], bos, seqlen)
        for m in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(cute.size(acc_y[m])):
                ch, v = c_y[i]
                if cutlass.const_expr(self.state_vk):  # y0 as prefill's, [V, K]
                    acc_y[m][i] = mY0[n, h, vbase + v, m * HALF + ch]
                else:
                    acc_y[m][i] = mY0[n, h, m * HALF + ch, vbase + v]

        # who issues a stage's copies: thread 0; with U the whole of warp 0, since cute.copy of
        # a TMA atom elects its issuing lane itself (elect.sync over the warp: a lone thread
        # there hangs), _load's other copies staying with thread 0
        loader = tid == 0
        if cutlass.const_expr(self.u_rows):
            loader = tid < 32
        if nch > 0 and loader:
            first = step_slot(slot0, nch, self.reverse, 0)
            self._load(mA, mBt, mDecay, mAdd, first, h, vsl, 0, loads)

        for j in cutlass.range(nch, unroll=1):
            slot = step_slot(slot0, nch, self.reverse, j)
            for s in cutlass.range_constexpr(STAGES):
                if j % STAGES == s:
                    if j + 1 < nch and loader:
                        nxt = step_slot(slot0, nch, self.reverse, j + 1)
                        self._load(mA, mBt, mDecay, mAdd, nxt, h, vsl, 1 - s, loads)
                    phase = (j // STAGES) % 2
                    o_step = None
                    if cutlass.const_expr(self.inline_outputs):
                        o_step = o_ctx._replace(raw_qg=raw_qg[s], raw_at=raw_at[s], j=j)
                    if cutlass.const_expr(self.split):
                        # after the outputs' warpgroup let go of chunk j - 2's S and X images
                        if j >= STAGES:
                            cute.arch.mbarrier_wait(split[2].iterator + O_DONE + s, 1 - phase)
                        self._step(mma_x, mma_y, acc_x, acc_y, c_x, c_y, f_a[s], f_bt[s],
                                   f_ys[s], f_xs[s], ys[s], xs[s], s_add[s], s_decay[s],
                                   s_mbar.iterator + s, phase, mStates, slot, h, vbase,
                                   x_full=split[2].iterator + X_FULL + s)  # fmt: skip
                    elif cutlass.const_expr(self.addend_wg):
                        # the addend of chunk j from the addend warpgroup's stage s
                        self._step(mma_x, mma_y, acc_x, acc_y, c_x, c_y, f_a[s], f_bt[s], f_y,
                                   f_x, s_y, s_x, s_add[s], s_decay[s], s_mbar.iterator + s,
                                   phase, mStates, slot, h, vbase,
                                   add_bars=buffers[7][6].iterator + s)  # fmt: skip
                    else:
                        self._step(mma_x, mma_y, acc_x, acc_y, c_x, c_y, f_a[s], f_bt[s], f_y,
                                   f_x, s_y, s_x, s_add[s], s_decay[s], s_mbar.iterator + s,
                                   phase, mStates, slot, h, vbase, o_step)  # fmt: skip

        for m in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(cute.size(acc_y[m])):
                ch, v = c_y[i]
                if cutlass.const_expr(self.state_vk):  # final as prefill's, [V, K]
                    mFinal[n, h, vbase + v, m * HALF + ch] = acc_y[m][i]
                else:
                    mFinal[n, h, m * HALF + ch, vbase + v] = acc_y[m][i]
        # gap slots after this sequence's chunks: zero states (coalesced over columns)
        if cutlass.const_expr(self.states):
            for slot in cutlass.range(slot0 + nch, gap_end, unroll=1):
                for it in cutlass.range_constexpr(HEAD_DIM * VS // NTHREADS):
                    e = tid + it * NTHREADS
                    mStates[slot, h, e // VS, vbase + e % VS] = mStates.element_type(0.0)

    @cute.jit
    def _sync(self):
        """The chain's barrier: the CTA's, or in a kernel of two warpgroups its own."""
        if cutlass.const_expr(self.split or self.addend_wg):
            cute.arch.barrier(barrier_id=CHAIN_BARRIER, number_of_threads=NTHREADS)
        else:
            cute.arch.sync_threads()

    @cute.jit
    def _step(self, mma_x, mma_y, acc_x, acc_y, c_x, c_y, f_a, f_bt, f_y, f_x, s_y, s_x,
              s_add, s_decay, mbar, phase, mStates, slot, h, vbase, o_step=None,
              x_full=None, add_bars=None):  # fmt: skip
        """One chunk: store the state entering it, then the two products (with outputs inline,
        the chunk's O after them: o_step; in the split kernel every thread arrives on x_full
        once the S and X images are written; with the addend warpgroup, add_bars: the stage's
        ADD_FULL mbarrier, the addend read from s_add by this thread's values, then ADD_FREE)."""
        for m in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(cute.size(acc_y[m])):
                ch, v = c_y[i]
                ch = m * HALF + ch
                y = acc_y[m][i]
                if cutlass.const_expr(self.states and not _bf16(mStates)):
                    mStates[slot, h, ch, vbase + v] = y
                y_hi = y.to(BFloat16)
                s_y[v, ch] = y_hi
                if cutlass.const_expr(self.passes == 3):
                    s_y[v, HEAD_DIM + ch] = (y - y_hi.to(Float32)).to(BFloat16)
        if cutlass.const_expr(self.states and _bf16(mStates)):
            # the state rounded once, as product 1 takes it (at one pass, y_hi): a thread's
            # columns v, v + 1 as one 4-byte pair
            pair = cute.make_rmem_tensor((2,), Float32)
            for m in cutlass.range_constexpr(2):
                for i in cutlass.range_constexpr(0, cute.size(acc_y[m]), 2):
                    ch, v = c_y[i]
                    pair[0] = acc_y[m][i]
                    pair[1] = acc_y[m][i + 1]
                    pair_at(mStates[slot, h, m * HALF + ch, None], vbase + v).store(
                        pair.load().to(BFloat16)
                    )
        cute.arch.mbarrier_wait(mbar, phase)  # the chunk's copies landed
        cute.arch.fence_proxy("async.shared", space="cta")
        self._sync()  # the chunk's images and Y's visible to every thread

        # Y = Diag(a) Y (+ Q reverse), before product 1 is issued: registers that an issued
        # wgmma may still read (any accumulator, for the compiler) make it wait for the product.
        if cutlass.const_expr(add_bars is not None):
            tid = cute.arch.thread_idx()[0]
            cute.arch.mbarrier_wait(add_bars + ADD_FULL, phase)  # the chunk's addend formed
            per = cute.size(acc_y[0])
            values = _addend_values(s_add, per)
            for m in cutlass.range_constexpr(2):
                for i in cutlass.range_constexpr(per):
                    ch, v = c_y[i]
                    ch = m * HALF + ch
                    acc_y[m][i] = acc_y[m][i] * s_decay[ch] + values[m * per + i, tid]
            cute.arch.mbarrier_arrive(add_bars + ADD_FREE)  # the stage read: free
        else:
            for m in cutlass.range_constexpr(2):
                for i in cutlass.range_constexpr(cute.size(acc_y[m])):
                    ch, v = c_y[i]
                    ch = m * HALF + ch
                    y = acc_y[m][i] * s_decay[ch]
                    if cutlass.const_expr(self.reverse):
                        if cutlass.const_expr(_bf16(s_add)):
                            y = y + s_add[ch, v].to(Float32)
                        else:
                            y = y + s_add[ch, v]
                    acc_y[m][i] = y

        # ---- product 1: acc = A Y (- P forward)
        for i in cutlass.range_constexpr(cute.size(acc_x)):
            acc_x[i] = Float32(0.0)
            if cutlass.const_expr(not self.reverse):
                tok, v = c_x[i]
                if cutlass.const_expr(self.u_rows):  # U in bf16
                    acc_x[i] = -s_add[tok, v].to(Float32)
                else:
                    acc_x[i] = -s_add[tok, v]
        cute.nvgpu.warpgroup.fence()
        gemm_passes(mma_x, acc_x, f_a, f_y, HEAD_DIM // 16, self.passes)
        cute.nvgpu.warpgroup.commit_group()
        if cutlass.const_expr(self.inline_outputs):
            # while product 1 runs: the chunk's plain Qg and Aqk (landed with the stage) into
            # their images
            self._to_image(o_step.raw_qg, o_step.s_qg, HEAD_DIM)
            self._to_image(o_step.raw_at, o_step.s_at, SCAN_CHUNK)
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
        if cutlass.const_expr(self.split):  # S and X ready for the outputs' warpgroup
            cute.arch.mbarrier_arrive(x_full)
        self._sync()
        if cutlass.const_expr(self.inline_outputs):
            o_step.acc_o.fill(0.0)  # every product accumulates
        cute.nvgpu.warpgroup.fence()
        for m in cutlass.range_constexpr(2):
            gemm_passes(mma_y, acc_y[m], f_bt[m], f_x, SCAN_CHUNK // 16, self.passes)
        if cutlass.const_expr(self.inline_outputs):
            gemm_passes(mma_x, o_step.acc_o, o_step.f_qg, f_y, HEAD_DIM // 16, 1)  # Qg S
            gemm_passes(
                mma_x, o_step.acc_o, o_step.f_at, o_step.f_xo, SCAN_CHUNK // 16, 1
            )  # + Aqk X
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(0)
        if cutlass.const_expr(self.inline_outputs):
            self._store_outputs(o_step, c_x, h, vbase)
        self._sync()  # the stage and the Y, X images free for the next chunk

    @cute.jit
    def _outputs_loop(self, mCu, n, n_slots, h, vbase, mma_x, buffers, out):
        """The split kernel's second warpgroup: for every chunk of the sequence, its own copies
        of Qg and Aqk (thread 128 issues them two chunks ahead, on the QG_FULL pair of
        mbarriers), then once the chain has written the chunk's S and X images (X_FULL),
        O = Qg S + Aqk X on its own accumulators (then those images are free: O_DONE), and O
        into the tokens' rows. Plain Qg and Aqk are laid out as images a chunk ahead, into the
        other of two image pairs, while the chunk's products run; with outputs_images the
        copies bring the images themselves. The chain waits on it only for the S and X images
        of two chunks back."""
        tid = cute.arch.thread_idx()[0] - NTHREADS
        VS = self.vs
        s_y, s_x = buffers[2], buffers[3]
        raw_qg, raw_at, s_qg, s_at, split = buffers[7]
        bars = split[2].iterator
        thr = mma_x.get_slice(tid)
        f_ys = [mma_x.make_fragment_B(thr.partition_B(y)) for y in (s_y, split[0])]
        f_xs = [mma_x.make_fragment_B(thr.partition_B(x)) for x in (s_x, split[1])]
        f_qgs = [mma_x.make_fragment_A(thr.partition_A(x)) for x in s_qg]  # a pair a parity
        f_ats = [mma_x.make_fragment_A(thr.partition_A(x)) for x in s_at]
        c_x = thr.partition_C(cute.make_identity_tensor((SCAN_CHUNK, VS)))  # (token, v)
        acc_o = cute.make_rmem_tensor(mma_x.partition_shape_C((SCAN_CHUNK, VS)), Float32)
        slot0, nch, _ = scan_slots(mCu, n, n_slots, SCAN_CHUNK)
        bos, seqlen, _, _ = sequence_slots(mCu, n, SCAN_CHUNK)
        o_ctx = OutputsStep(f_qgs[0], f_ats[0], None, acc_o, s_qg, s_at, out[2], bos, seqlen)
        raws = (raw_qg, raw_at, out[0], out[1])
        # chunks 0 and 1 copied; chunk 0 laid out (plain), before the loop
        if tid == 0:
            for c in cutlass.range_constexpr(STAGES):
                if c < nch:
                    self._load_outputs_operands(
                        raws, step_slot(slot0, nch, False, c), h, c, bars + QG_FULL + c
                    )
        if cutlass.const_expr(not self.images):
            if nch > 0:
                cute.arch.mbarrier_wait(bars + QG_FULL, 0)
                self._to_image(raw_qg[0], s_qg[0], HEAD_DIM, tid)
                self._to_image(raw_at[0], s_at[0], SCAN_CHUNK, tid)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=OUTPUTS_BARRIER, number_of_threads=NTHREADS)
        for j in cutlass.range(nch, unroll=1):
            for s in cutlass.range_constexpr(STAGES):
                if j % STAGES == s:
                    phase = (j // STAGES) % 2
                    if cutlass.const_expr(self.images):
                        cute.arch.mbarrier_wait(bars + QG_FULL + s, phase)  # the images landed
                    elif j + STAGES < nch and tid == 0:
                        # stage s held chunk j's plain Qg and Aqk, laid out before the last
                        # barrier: chunk j + 2's copies go there
                        nxt = step_slot(slot0, nch, False, j + STAGES)
                        self._load_outputs_operands(raws, nxt, h, s, bars + QG_FULL + s)
                    cute.arch.mbarrier_wait(bars + X_FULL + s, phase)  # S and X written
                    acc_o.fill(0.0)  # every product accumulates
                    cute.nvgpu.warpgroup.fence()
                    gemm_passes(mma_x, acc_o, f_qgs[s], f_ys[s], HEAD_DIM // 16, 1)  # Qg S
                    gemm_passes(mma_x, acc_o, f_ats[s], f_xs[s], SCAN_CHUNK // 16, 1)  # + Aqk X
                    cute.nvgpu.warpgroup.commit_group()
                    if cutlass.const_expr(not self.images):
                        # while they run: chunk j + 1's plain Qg and Aqk into the other image
                        # pair (last read by chunk j - 1's products, before the last barrier)
                        if j + 1 < nch:
                            cute.arch.mbarrier_wait(bars + QG_FULL + 1 - s, ((j + 1) // 2) % 2)
                            self._to_image(raw_qg[1 - s], s_qg[1 - s], HEAD_DIM, tid)
                            self._to_image(raw_at[1 - s], s_at[1 - s], SCAN_CHUNK, tid)
                            cute.arch.fence_proxy("async.shared", space="cta")
                    cute.nvgpu.warpgroup.wait_group(0)
                    cute.arch.mbarrier_arrive(bars + O_DONE + s)
                    self._store_outputs(o_ctx, c_x, h, vbase, j)
                    # every warp's products have read chunk j's images, and chunk j + 1's are
                    # written, before either is used again
                    cute.arch.barrier(barrier_id=OUTPUTS_BARRIER, number_of_threads=NTHREADS)
                    if cutlass.const_expr(self.images):
                        if j + STAGES < nch and tid == 0:  # stage s free: chunk j + 2's images
                            nxt = step_slot(slot0, nch, False, j + STAGES)
                            self._load_outputs_operands(raws, nxt, h, s, bars + QG_FULL + s)

    @cute.jit
    def _addend_loop(self, mCu, n, n_slots, h, vbase, mma_y, buffers, s_bt, out):
        """The addend warpgroup (ReverseScanAddendTcSm90): for every chunk of the sequence in
        the chain's order, the CTA's V slice of dL/dS = Qg^T dO - W^T (Aqk^T dO) ([128, VS],
        one bf16 pass a product, float32 accumulation, -X rounded to bf16 on its way as the
        state cotangent kernel rounds it), on mma_y (the chain's product 2: A M-major, B
        N-major): Qg's and Aqk's K-major images viewed M-major are Qg^T and Aqk^T, W^T is the
        chain's own B^T stage (waited on through the chain's mbarrier), dO's slice comes from
        the tokens' rows (zero past the sequence). Qg and Aqk on its own bulk copies a chunk
        ahead (ADD_QG); the result into addend stage s by thread (ADD_FULL), which the chain
        frees once read (ADD_FREE)."""
        tid = cute.arch.thread_idx()[0] - NTHREADS
        VS = self.vs
        raw_add, s_mbar = buffers[4], buffers[6]
        raw_qg, raw_at, img_qg, img_at, s_do, s_xn, bars_t = buffers[7]
        bars = bars_t.iterator
        mQg, mAttn, mDo = out
        thr = mma_y.get_slice(tid)
        # Qg [64 tokens, 128 channels] and Aqk [64, 64] laid out K-major are the M-major images
        # of Qg^T and Aqk^T (the same bytes, as the chunk core's W serves as A and as B^T)
        s_qg = cute.make_tensor(img_qg.iterator, inter_image_layout(SCAN_CHUNK, HEAD_DIM))
        s_at = cute.make_tensor(img_at.iterator, inter_image_layout(SCAN_CHUNK, SCAN_CHUNK))
        qg_t = cute.make_tensor(img_qg.iterator, inter_image_layout(HEAD_DIM, SCAN_CHUNK, True))
        at_t = cute.make_tensor(img_at.iterator, inter_image_layout(SCAN_CHUNK, SCAN_CHUNK, True))
        halves = [cute.local_tile(qg_t, (HALF, SCAN_CHUNK), (m, 0)) for m in range(2)]
        f_qg = [mma_y.make_fragment_A(thr.partition_A(x)) for x in halves]
        f_at = mma_y.make_fragment_A(thr.partition_A(at_t))
        f_w = [[mma_y.make_fragment_A(thr.partition_A(
                    cute.local_tile(s_bt[s], (HALF, self.bt_k), (m, 0)))) for m in range(2)]
               for s in range(STAGES)]  # fmt: skip
        f_do = mma_y.make_fragment_B(thr.partition_B(s_do))
        f_xn = mma_y.make_fragment_B(thr.partition_B(s_xn))
        c_y = thr.partition_C(cute.make_identity_tensor((HALF, VS)))  # (row % 64, v)
        acc = [cute.make_rmem_tensor(mma_y.partition_shape_C((HALF, VS)), Float32)
               for _ in range(2)]  # fmt: skip
        acc_x = cute.make_rmem_tensor(mma_y.partition_shape_C((HALF, VS)), Float32)
        per = cute.size(acc[0])
        slot0, nch, _ = scan_slots(mCu, n, n_slots, SCAN_CHUNK)
        raws = (raw_qg, raw_at, mQg, mAttn)
        lanes = VS // PIECE  # 16-byte pieces of a dO row's slice
        rows_a_pass = NTHREADS // lanes
        r_do = cute.make_rmem_tensor((SCAN_CHUNK // rows_a_pass, PIECE), BFloat16)
        if nch > 0:
            first = step_slot(slot0, nch, True, 0)
            if tid == 0:
                self._load_outputs_operands(raws, first, h, 0, bars + ADD_QG)
            self._load_do_rows(mDo, mCu, first, h, vbase, r_do, tid)
        for j in cutlass.range(nch, unroll=1):
            for s in cutlass.range_constexpr(STAGES):
                if j % STAGES == s:
                    phase = (j // STAGES) % 2
                    if j + 1 < nch and tid == 0:
                        nxt = step_slot(slot0, nch, True, j + 1)
                        self._load_outputs_operands(raws, nxt, h, 1 - s, bars + ADD_QG + 1 - s)
                    # dO's V slice of the chunk's rows (loaded a chunk ahead) into its image,
                    # then the next chunk's rows into the registers
                    for p in cutlass.range_constexpr(SCAN_CHUNK // rows_a_pass):
                        i = p * rows_a_pass + tid // lanes
                        store_piece(s_do, (tid % lanes) * PIECE, i, r_do[p, None].load(), True)
                    if j + 1 < nch:
                        nxt = step_slot(slot0, nch, True, j + 1)
                        self._load_do_rows(mDo, mCu, nxt, h, vbase, r_do, tid)
                    cute.arch.mbarrier_wait(bars + ADD_QG + s, phase)
                    self._to_image(raw_qg[s], s_qg, HEAD_DIM, tid)
                    self._to_image(raw_at[s], s_at, SCAN_CHUNK, tid)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier(barrier_id=ADDEND_BARRIER, number_of_threads=NTHREADS)
                    # X = Aqk^T dO, and Qg^T dO onto both halves
                    acc_x.fill(0.0)
                    for m in cutlass.range_constexpr(2):
                        acc[m].fill(0.0)
                    cute.nvgpu.warpgroup.fence()
                    gemm_passes(mma_y, acc_x, f_at, f_do, SCAN_CHUNK // 16, 1)
                    for m in cutlass.range_constexpr(2):
                        gemm_passes(mma_y, acc[m], f_qg[m], f_do, SCAN_CHUNK // 16, 1)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(0)
                    for i in cutlass.range_constexpr(per):  # -X into B's image, bf16
                        tok, v = c_y[i]
                        s_xn[v, tok] = (-acc_x[i]).to(BFloat16)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier(barrier_id=ADDEND_BARRIER, number_of_threads=NTHREADS)
                    # + W^T (-X), W^T from the chain's stage once its copies landed
                    cute.arch.mbarrier_wait(s_mbar.iterator + s, phase)
                    cute.nvgpu.warpgroup.fence()
                    for m in cutlass.range_constexpr(2):
                        gemm_passes(mma_y, acc[m], f_w[s][m], f_xn, SCAN_CHUNK // 16, 1)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(0)
                    if j >= STAGES:  # the chain has read chunk j - 2's addend from stage s
                        cute.arch.mbarrier_wait(bars + ADD_FREE + s, 1 - phase)
                    values = _addend_values(raw_add[s], per)
                    for m in cutlass.range_constexpr(2):
                        for i in cutlass.range_constexpr(per):
                            values[m * per + i, tid] = acc[m][i]
                    cute.arch.mbarrier_arrive(bars + ADD_FULL + s)
                    # every warp's products have read the images before the next chunk's
                    # overwrite them (a warp's wait_group covers its own wgmma only)
                    cute.arch.barrier(barrier_id=ADDEND_BARRIER, number_of_threads=NTHREADS)

    @cute.jit
    def _load_do_rows(self, mDo, mCu, slot, h, vbase, r_do, tid):
        """The addend warpgroup's thread tid: its 16-byte pieces of dO's V slice [64, VS] of
        chunk slot `slot` (rows past the slot's tokens zero) into r_do."""
        lanes = self.vs // PIECE
        rows_a_pass = NTHREADS // lanes
        row0, count = slot_rows(mCu, slot, mDo.shape[0], SCAN_CHUNK)
        r_do.fill(0.0)
        for p in cutlass.range_constexpr(SCAN_CHUNK // rows_a_pass):
            i = p * rows_a_pass + tid // lanes
            if i < count:
                r_do[p, None].store(
                    row_piece(mDo[row0 + i, h, None], vbase + (tid % lanes) * PIECE, PIECE).load()
                )

    @cute.jit
    def _load_outputs_operands(self, raws, slot, h, stage: cutlass.Constexpr[int], mbar):
        """One thread: the chunk's Qg [64, 128] and Aqk [64, 64] (bf16, plain) into the split
        kernel's `stage`, two bulk copies completing on mbar."""
        raw_qg, raw_at, mQg, mAttn = raws
        cute.arch.mbarrier_arrive_and_expect_tx(mbar, (QG_ELEMS + AT_ELEMS) * 2)
        for src, buf, elems in (
            (mQg[slot, h, None], raw_qg[stage], QG_ELEMS),
            (mAttn[slot, h, None], raw_at[stage], AT_ELEMS),
        ):
            dst = cute.make_tensor(buf.iterator, cute.make_layout(elems))
            atom = cute.make_copy_atom(
                cpasync.CopyBulkG2SOp(), BFloat16, num_bits_per_copy=elems * BFloat16.width
            )
            cute.copy(atom, src, dst, mbar_ptr=mbar)

    @cute.jit
    def _to_image(
        self, raw: cute.Tensor, image: cute.Tensor, cols: cutlass.Constexpr[int], tid=None
    ):
        """A plain row-major [64, cols] bf16 array in shared memory into its K-major image, 16
        bytes a piece, four loads in flight a thread. The eight threads of a 128-byte
        phase take eight rows of one 8-row block and eight different pieces (piece (c + r) %
        per of row r): their loads hit eight different 16-byte bank groups (rows lie a multiple
        of 128 bytes apart) and so do their stores (one core matrix's eight rows)."""
        if cutlass.const_expr(tid is None):  # else the thread's index in its warpgroup
            tid, _, _ = cute.arch.thread_idx()
        per = cols // PIECE  # pieces a row
        tasks = SCAN_CHUNK * per // NTHREADS
        batch = 4  # loads in flight a thread (the registers the scan has left)
        r_x = cute.make_rmem_tensor((batch, PIECE), BFloat16)
        for b in cutlass.range_constexpr(tasks // batch):
            for t in cutlass.range_constexpr(batch):
                row, piece = self._piece_of((b * batch + t) * NTHREADS + tid, per)
                r_x[t, None].store(row_piece(raw, row * cols + piece * PIECE, PIECE).load())
            for t in cutlass.range_constexpr(batch):
                row, piece = self._piece_of((b * batch + t) * NTHREADS + tid, per)
                store_piece(image, row, piece * PIECE, r_x[t, None].load(), False)

    @staticmethod
    def _piece_of(q, per: int):
        """(row, piece) of task q of a [64, per pieces] array: rows r = 8 b + q % 8 of row
        block b = (q / 8) % 8, piece (c + q % 8) % per with c = q / 64."""
        lane = q % 8
        group = q // 8
        return (group % 8) * 8 + lane, (group // 8 + lane) % per

    @cute.jit
    def _store_outputs(self, o_step, c_x, h, vbase, chunk=None):
        """acc_o, the chunk's O for the CTA's V slice, as bf16 pairs into the rows of the tokens
        step `chunk` (None: o_step.j) of the sequence holds (rows past its end, or outside
        [0, T) on bad boundaries, write nothing)."""
        acc_o, mO, bos, seqlen = o_step.acc_o, o_step.m_o, o_step.bos, o_step.seqlen
        j = o_step.j if chunk is None else chunk
        row0 = bos + j * SCAN_CHUNK
        count = cutlass.min(cutlass.min(seqlen - j * SCAN_CHUNK, SCAN_CHUNK), mO.shape[0] - row0)
        if row0 < 0:
            count = Int32(0)
        pair = cute.make_rmem_tensor((2,), Float32)
        for e in cutlass.range_constexpr(0, cute.size(acc_o), 2):
            tok, v = c_x[e]
            if tok < count:
                pair[0] = acc_o[e]
                pair[1] = acc_o[e + 1]
                pair_at(mO[row0 + tok, h, None], vbase + v).store(pair.load().to(BFloat16))

    @cute.jit
    def _load(self, mA, mBt, mDecay, mAdd, slot, h, vsl, stage: cutlass.Constexpr[int], loads):
        """One chunk's copies into `stage` (_bulk_loads'), by thread 0; with U (mAdd = (the TMA
        atom, its tensor)) called by all of warp 0: thread 0's bulk copies, then U's [64, VS]
        slice at (slot, h) by one TMA copy that the warp issues together (cute.copy of a TMA
        atom elects one lane of the warp; its bytes may land before thread 0's arrival, which
        the phase still waits for)."""
        if cutlass.const_expr(self.u_rows):
            if cute.arch.thread_idx()[0] == 0:
                self._bulk_loads(mA, mBt, mDecay, mAdd, slot, h, vsl, stage, loads)
            tma_u, m_u = mAdd
            raw_add, s_mbar = loads[2], loads[4]
            g_u = cute.local_tile(m_u, (SCAN_CHUNK, self.vs), (None, None))
            s_u = cute.make_tensor(
                cute.recast_ptr(raw_add[stage].iterator, dtype=BFloat16), u_slice_layout(self.vs)
            )
            t_s, t_g = cpasync.tma_partition(
                tma_u, 0, cute.make_layout(1), cute.group_modes(s_u, 0, 2),
                cute.group_modes(g_u, 0, 2),
            )  # fmt: skip
            cute.copy(tma_u, t_g[None, slot * mA.shape[1] + h, vsl], t_s,
                      tma_bar_ptr=s_mbar.iterator + stage)  # fmt: skip
        else:
            self._bulk_loads(mA, mBt, mDecay, mAdd, slot, h, vsl, stage, loads)

    @cute.jit
    def _bulk_loads(self, mA, mBt, mDecay, mAdd, slot, h, vsl, stage: cutlass.Constexpr[int],
                    loads):  # fmt: skip
        """One thread: one chunk's A and B^T images, addend slice (not U's: _load) and decay
        (with the outputs inline, not the split kernel, Qg and Aqk plain too) into `stage`,
        bulk copies completing on the stage's mbarrier, whose expected bytes count U's slice
        where the scan takes U."""
        raw_a, raw_bt, raw_add, s_decay, s_mbar = loads[:5]
        mbar = s_mbar.iterator + stage
        if cutlass.const_expr(self.u_rows):  # U's slice, bf16
            nbytes = 2 * self.image_elems * 2 + HEAD_DIM * 4 + SCAN_CHUNK * self.vs * 2
        elif cutlass.const_expr(self.addend_wg):  # the addend warpgroup forms it
            nbytes = 2 * self.image_elems * 2 + HEAD_DIM * 4
        else:
            add_elems = self.addend_rows * self.vs
            add_type = Float32 if mAdd is None else mAdd.element_type  # float32, bf16 reverse
            nbytes = 2 * self.image_elems * 2 + add_elems * add_type.width // 8 + HEAD_DIM * 4
        if cutlass.const_expr(self.inline_outputs):  # Qg and Aqk plain, bf16
            nbytes = nbytes + (QG_ELEMS + AT_ELEMS) * 2
        cute.arch.mbarrier_arrive_and_expect_tx(mbar, nbytes)
        pieces = (
            (mA[slot, h, None], raw_a[stage].iterator, BFloat16, self.image_elems),
            (mBt[slot, h, None], raw_bt[stage].iterator, BFloat16, self.image_elems),
        )
        if cutlass.const_expr(not self.u_rows and not self.addend_wg):
            add_ptr = raw_add[stage].iterator  # a float32 stage; a bf16 addend fills half
            if cutlass.const_expr(add_type == BFloat16):
                add_ptr = cute.recast_ptr(add_ptr, dtype=BFloat16)
            pieces = (*pieces, (mAdd[slot, h, vsl, None], add_ptr, add_type, add_elems))
        pieces = (*pieces, (mDecay[slot, h, None], s_decay[stage].iterator, Float32, HEAD_DIM))
        if cutlass.const_expr(self.inline_outputs):
            raw_qg, raw_at, mQg, mAttn = loads[5:]
            pieces = (
                *pieces,
                (mQg[slot, h, None], raw_qg[stage].iterator, BFloat16, QG_ELEMS),
                (mAttn[slot, h, None], raw_at[stage].iterator, BFloat16, AT_ELEMS),
            )
        for src, ptr, dtype, elems in pieces:
            dst = cute.make_tensor(ptr, cute.make_layout(elems))  # the stage may be larger
            atom = cute.make_copy_atom(
                cpasync.CopyBulkG2SOp(), dtype, num_bits_per_copy=elems * dtype.width
            )
            cute.copy(atom, src, dst, mbar_ptr=mbar)


class ChunkStateScanOutputsTcSm90:
    """The forward tensor-core scan at one bf16 pass that writes every chunk's outputs too
    (the module's docstring): ChunkStateScanTcSm90's inputs and results, except the addend U
    [slots, H, 64 * 128] bfloat16 (plain, not V-sliced), and Qg [slots, H, 64 * 128], Aqk
    [slots, H, 64 * 64] (the chunk core's bfloat16 u, qg and attn, row-major, flat per slot;
    with outputs_images qg and attn in the scan's operand order instead) in, o [T, H, 128]
    bfloat16 out (the rows of tokens in no sequence unwritten); y0 and final in prefill's
    layout, [N, H, V, K] (the chunk states [K, V] as the scan's), so that a
    forward's only launches are the chunk core and this kernel (XLA cancels the transposes
    around the call against xla.forward's own).
    states=False (ChunkOutputsScanTcSm90, a call that is not differentiated): no chunk states
    stored, the final states and o alone. outputs_warpgroup (the split kernel): a second
    warpgroup takes the O products and stores off the chain, from S and X images the chain
    writes a stage each, with Qg and Aqk on copies of its own
    (ChunkStateScanTcSm90._outputs_loop; two image pairs, chunk j + 1's laid out while chunk
    j's products run: about 178 KiB of shared memory at VS = 16, 194 at 32; one pair before:
    154 and 170). outputs_images (with outputs_warpgroup): qg and attn come as
    their K-major operand images, flat (the chunk core's images variant), which the copies
    bring into two image stages as they are: that warpgroup lays nothing out, and the
    separate images' 48 KiB of shared memory go."""

    def __init__(
        self, v_slice: int, states: bool = True, outputs_warpgroup: bool = False,
        outputs_images: bool = False,
    ):  # fmt: skip
        self.vs = v_slice
        self.scan = ChunkStateScanTcSm90(
            ScanConfig(reverse=False, v_slice=v_slice), passes=1, outputs=True, states=states,
            outputs_warpgroup=outputs_warpgroup, outputs_images=outputs_images,
        )  # fmt: skip

    @cute.jit
    def __call__(
        self,
        a_img: cute.Tensor,
        bt_img: cute.Tensor,
        decay: cute.Tensor,
        addend: cute.Tensor,
        cu_seqlens: cute.Tensor,
        y0: cute.Tensor,
        qg: cute.Tensor,
        attn: cute.Tensor,
        states: cute.Tensor,
        final: cute.Tensor,
        o: cute.Tensor,
        stream: cuda.CUstream,
    ):
        n_seq = cu_seqlens.shape[0] - 1
        heads = y0.shape[1]
        mma_x, mma_y = scan_mmas(self.vs)
        tma_u, u = u_tma(addend, self.vs)
        self.kernel(
            a_img, bt_img, decay, u, cu_seqlens, y0, qg, attn, states, final, o, mma_x, mma_y,
            tma_u,
        ).launch(
            grid=[HEAD_DIM // self.vs, heads, n_seq], block=[self.scan.threads, 1, 1],
            stream=stream,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mA: cute.Tensor,
        mBt: cute.Tensor,
        mDecay: cute.Tensor,
        mAdd: cute.Tensor,
        mCu: cute.Tensor,
        mY0: cute.Tensor,
        mQg: cute.Tensor,
        mAttn: cute.Tensor,
        mStates: cute.Tensor,
        mFinal: cute.Tensor,
        mO: cute.Tensor,
        mma_x: cute.TiledMma,
        mma_y: cute.TiledMma,
        tma_u: cute.CopyAtom,
    ):
        vsl, h, n = cute.arch.block_idx()
        accumulate_always(mma_x, mma_y)
        buffers = self.scan.allocate(self.scan.addend_rows)
        self.scan.scan(mA, mBt, mDecay, (tma_u, mAdd), mCu, mY0, mStates, mFinal, mma_x, mma_y,
                       buffers, vsl, h, n, (mQg, mAttn, mO))  # fmt: skip


class ChunkOutputsScanTcSm90(ChunkStateScanOutputsTcSm90):
    """ChunkStateScanOutputsTcSm90 without the chunk states: (final, o) from the same inputs,
    for a forward that autodiff does not differentiate (64 KiB a chunk and head not stored)."""

    def __init__(
        self, v_slice: int, outputs_warpgroup: bool = False, outputs_images: bool = False
    ):  # fmt: skip
        super().__init__(
            v_slice, states=False, outputs_warpgroup=outputs_warpgroup,
            outputs_images=outputs_images,
        )  # fmt: skip

    @cute.jit
    def __call__(
        self,
        a_img: cute.Tensor,
        bt_img: cute.Tensor,
        decay: cute.Tensor,
        addend: cute.Tensor,
        cu_seqlens: cute.Tensor,
        y0: cute.Tensor,
        qg: cute.Tensor,
        attn: cute.Tensor,
        final: cute.Tensor,
        o: cute.Tensor,
        stream: cuda.CUstream,
    ):
        n_seq = cu_seqlens.shape[0] - 1
        heads = y0.shape[1]
        mma_x, mma_y = scan_mmas(self.vs)
        tma_u, u = u_tma(addend, self.vs)
        self.kernel(
            a_img, bt_img, decay, u, cu_seqlens, y0, qg, attn, final, o, mma_x, mma_y, tma_u
        ).launch(
            grid=[HEAD_DIM // self.vs, heads, n_seq], block=[self.scan.threads, 1, 1],
            stream=stream,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mA: cute.Tensor,
        mBt: cute.Tensor,
        mDecay: cute.Tensor,
        mAdd: cute.Tensor,
        mCu: cute.Tensor,
        mY0: cute.Tensor,
        mQg: cute.Tensor,
        mAttn: cute.Tensor,
        mFinal: cute.Tensor,
        mO: cute.Tensor,
        mma_x: cute.TiledMma,
        mma_y: cute.TiledMma,
        tma_u: cute.CopyAtom,
    ):
        vsl, h, n = cute.arch.block_idx()
        accumulate_always(mma_x, mma_y)
        buffers = self.scan.allocate(self.scan.addend_rows)
        self.scan.scan(mA, mBt, mDecay, (tma_u, mAdd), mCu, mY0, None, mFinal, mma_x, mma_y,
                       buffers, vsl, h, n, (mQg, mAttn, mO))  # fmt: skip


class ReverseScanAddendTcSm90:
    """The reverse tensor-core scan at one bf16 pass that forms its addend itself: the outputs'
    part of each chunk's state cotangent, dL/dS = Qg^T dO - W^T (Aqk^T dO) (the state cotangent
    kernel's, kda_state_cotangent_sm90), for the CTA's V slice on a second warpgroup a chunk
    ahead of the chain (ChunkStateScanTcSm90._addend_loop), so that neither its launch nor its
    64 KiB a slot and head through HBM remain. Inputs: the chunk core's kd_img (A) and w_img
    (B^T) in the scan's operand order, decay [slots, H, 128], qg [slots, H, 64 * 128] and
    attn [slots, H, 64 * 64] (bf16, plain, flat per slot), dO [T, H, 128] bf16 in the tokens'
    rows, cu_seqlens, d_final [N, H, K, V]; results g_end [slots, H, K, V] (the cotangent of
    the state leaving each slot; gap slots zero) and d_y0 [N, H, K, V], float32. About 163
    KiB of shared memory at VS = 16: one CTA an SM."""

    def __init__(self, v_slice: int):
        self.vs = v_slice
        self.scan = ChunkStateScanTcSm90(
            ScanConfig(reverse=True, v_slice=v_slice), passes=1, addend_warpgroup=True
        )

    @cute.jit
    def __call__(
        self,
        kd_img: cute.Tensor,
        w_img: cute.Tensor,
        decay: cute.Tensor,
        qg: cute.Tensor,
        attn: cute.Tensor,
        d_out: cute.Tensor,
        cu_seqlens: cute.Tensor,
        d_final: cute.Tensor,
        g_end: cute.Tensor,
        d_y0: cute.Tensor,
        stream: cuda.CUstream,
    ):
        n_seq = cu_seqlens.shape[0] - 1
        heads = d_final.shape[1]
        mma_x, mma_y = scan_mmas(self.vs)
        self.kernel(
            kd_img, w_img, decay, qg, attn, d_out, cu_seqlens, d_final, g_end, d_y0, mma_x, mma_y
        ).launch(
            grid=[HEAD_DIM // self.vs, heads, n_seq], block=[self.scan.threads, 1, 1],
            stream=stream,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mA: cute.Tensor,
        mBt: cute.Tensor,
        mDecay: cute.Tensor,
        mQg: cute.Tensor,
        mAttn: cute.Tensor,
        mDo: cute.Tensor,
        mCu: cute.Tensor,
        mY0: cute.Tensor,
        mStates: cute.Tensor,
        mFinal: cute.Tensor,
        mma_x: cute.TiledMma,
        mma_y: cute.TiledMma,
    ):
        vsl, h, n = cute.arch.block_idx()
        accumulate_always(mma_x, mma_y)
        buffers = self.scan.allocate(self.scan.addend_rows)
        self.scan.scan(mA, mBt, mDecay, None, mCu, mY0, mStates, mFinal, mma_x, mma_y, buffers,
                       vsl, h, n, (mQg, mAttn, mDo))  # fmt: skip
