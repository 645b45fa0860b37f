"""The exact 64-token chunk core on tensor cores, sm_90a CuTe DSL: every chunk's state-independent
operands, parallel over (chunk slot, head). What xla._chunk_operands computes, read straight from
the packed tokens, plus two of its backward's residuals.

Per slot (64 rows; rows past the sequence's end and gap slots read as q = k = v = g = beta = 0),
with Gamma the in-chunk cumsum of g (gates below constants.GATE_FLOOR taken as it, as in xla.py):
  kk_ij = sum_d k_id k_jd exp(Gamma_id - Gamma_jd), qk_ij alike with q_i, for j <= i
  Aqk = scale * qk (j <= i), L = strictLower(beta_i kk_ij)
  [W | U] = (I + L)^-1 [beta k exp(Gamma) | beta v]
  Qg = scale q exp(Gamma), Kd = k exp(Gamma_last - Gamma), a = exp(Gamma_last)

The decay split (chunk64.py): rows anchored at their block's middle row wherever the decay
allows (every pair j <= i one product), else at its first row with the diagonal blocks taken
pair by pair; no factor can overflow, whatever the gate.

The products on wgmma, bfloat16 operands (one pass by default, about 2^-9 relative; three with
hi/lo splits, hi*hi + lo*hi + hi*lo, about 2^-16), float32 accumulation:
  [kk | qk] rows: left [64, 128] (k or q, anchored; register A) x right^T, right packing each
    block's anchor with the rows j it pairs with: 16 + 32 + 48 + 64 = 160 columns (m64n160,
    K = 128). Warpgroup 0 takes kk, warpgroup 1 qk, at once.
  [W | U] = T^-1 R: T^-1 [64, 64] (float32 by 16-row blocks: the diagonal blocks' inverses by
    forward substitution, then the blocks below by block substitution; register A) x R [64, 256]
    (K = 64): warpgroup 0 takes W (m64n128), warpgroup 1 U.

One CTA of two warpgroups a (slot, head); thread (part, d) = channel d of half the rows for the
cumsum, the operand images and the outputs. At one pass a CTA takes 108 KiB of
shared memory and at most 128 registers a thread (the kk/qk operand is built and issued in two
K halves: whole, with its accumulator, it passed 128 and ptxas serialised the wgmma), so two
CTAs share an SM and one's memory phases overlap the other's products. H200, globaltimer
stamps: 33 us a CTA at two an SM against 28 at one an SM before (one warpgroup issuing every
product, 157 KiB); the kernel at 2048x12x1 / 8192x16x1 84 / 324 us against 95 / 459. Reading
q from global memory at the operand's coordinates instead of keeping it in shared memory took
the products from 4.5 to 15 us a CTA.
Outputs: bfloat16 u, qg [slots, H, 64, 128], attn [slots, H, 64, 64] (zero above the
diagonal) and tinv = T^-1 [slots, H, 64, 64] (the backward's solve T^-T d[W | U] is then one
product); float32 gamma [slots, H, 64, 128], kk [slots, H, 64, 64], decay [slots, H, 128]; and
bfloat16 w_img, kd_img [slots, H, 64 * 128]: W and Kd in the single-pass tensor-core state
scan's operand order (chunk_io.scan_order_offset), which both scan directions bring into shared
memory as they are, and the only form of W and Kd the other kernels read. Every consumer takes
W, U, Qg, Aqk, Kd and T^-1 as bf16 operands (U as V_new's addend too), so they leave in bf16:
128 KiB a (slot, head) against 240 before.

The element-wise phases move 16 bytes a thread: the loads of g, q, k and v, the R^T images,
Aqk, kk and T^-1, and Qg, Kd and Gamma, thread (row r8 + 16 m, channels c8 .. c8 + 7); W and U
leave through bf16 stages in the region once the solve has read it. Nsight Compute had put 27 %
of the kernel's stall samples on the scalar and pair stores of the last phase, and 15 % on the
loads of g, q and k 2 and 4 bytes at a time; H200 (benchmarks.kernel_profile), with 16-byte
stores: 53.3 / 259.8 us at 2048x12x1 / 8192x16x1 against 74.2 / 288.8
for the training variant, 48.3 / 234.7 against 66.7 / 252.9 for the forward alone.

Phases (H100, benchmarks/chunk_core_phases.py): the loads, the kk/qk phase and T^-1 take 60-70%
of a CTA; the kk/qk phase's time is its operand build (one scalar shared-memory load of k or q
and two of Gamma an element), not the product. It is now built from two-channel loads
(anchored_pairs): the same arithmetic, bit for bit (H100, 2026-12-06, every output of the
forward-alone and training variants at one and three passes), 0.4 us off a CTA at
2048x12x1 and 8192x16x1, the span 51.4 -> 49.1 and 243.5 -> 234.2 us. Once the first loads
are in, a CTA asks L2 for its chunk's v rows (prefetch.py), which it loads after T^-1's
diagonal blocks: the training variant 59.3-59.6 -> 57.3-57.6 us at 2048x12x1 and 243.3-245.0
-> 240.0-241.8 at 8192x16x1 (H100, 2026-12-07, results/2026-12-07-h100-h-*; the training
step's every result bit for bit as before; the rows then not bounded by the tensor under bad
cu_seqlens, now by slot_rows). Bounded, on an H200 (2026-12-07, results/2026-12-07-h200-i-*):
56.8-56.9 us at 2048x12x1 against 57.1-57.6 without it, 234.3-234.8 against 232.6-233.2 at
8192x16x1 (a wash there); the step's results bit for bit as before.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.warpgroup as warpgroup
from cutlass import BFloat16, Float32, Int32
from cutlass.memory import SmemAllocator

from jax_kda.constants import GATE_FLOOR, HEAD_DIM, L2_EPS, SCAN_CHUNK
from jax_kda.sm90.kernels.chunk64 import (
    BLOCK,
    BLOCKS,
    PACKED,
    PAIR_ROW,
    ROWS,
    below_diagonal_blocks,
    choose_anchors,
    diagonal_inverses,
    exp_fast,
    packed_row,
    put_right_factors,
)
from jax_kda.sm90.kernels.chunk_io import pair_at, scan_order_offset
from jax_kda.sm90.kernels.input_prep import InputPrep, kda_gate
from jax_kda.sm90.kernels.prefetch import prefetch_rows
from jax_kda.sm90.kernels.varlen import slot_owner, slot_rows
from jax_kda.sm90.kernels.wgmma import (
    bf16_tiled_mma,
    image_k,
    image_layout,
    load_f32,
    product_passes,
    put_piece,
    row_piece,
    split_a_operands,
    vec4,
    view,
)

WGS = 2  # warpgroups: kk and qk, then W and U; the element-wise phases split the rows
NTHREADS = 128 * WGS
WARPS = NTHREADS // 32
HALF = ROWS // WGS  # rows of a warpgroup in the row-split phases
PADDED_ROW = HEAD_DIM + 8
"""Row pitch of q, k (bf16) and Gamma (float32) in shared memory: the register-A operands read
them at fragment coordinates (8 rows x 4 column pairs a warp) without bank conflicts."""
PAIR_BYTES = ROWS * PAIR_ROW * 4  # a float32 [64, 64] pair matrix, rows padded
M_BYTES = (BLOCKS - 1) * BLOCK * BLOCK * 4 + (BLOCKS - 1) * BLOCK * 4  # T^-1's block scratch


QK_OFFSET = PAIR_BYTES + M_BYTES  # qk, then T^-1, in the region (16-byte aligned)
STAGE_BYTES = ROWS * PADDED_ROW * 2  # W or U as bf16 rows on their way out
LANES = 8  # channels a thread takes in the vectorised phases: 16 bytes of bf16
GROUPS = HEAD_DIM // LANES  # channel groups of a row
VEC_ROWS = NTHREADS // GROUPS  # rows a pass of the vectorised phases covers
TASKS = ROWS // VEC_ROWS  # (row, channel group) pieces a thread takes there
G_PIECES = ROWS * HEAD_DIM // (NTHREADS * 4)  # g's 16-byte pieces (four float32) a thread loads


@cute.jit
def l2_normalize_row_piece(piece: cute.Tensor):
    """piece (LANES bf16 of a row, in registers) *= rsqrt(sum of the row's squares + 1e-6), in
    float32, then bf16 (gate.l2_normalize): the row's GROUPS pieces are on GROUPS consecutive
    lanes of one warp (the vectorised phases' thread order), which sum their squares by
    butterfly shuffles; every lane calls it."""
    x = cute.make_rmem_tensor((LANES,), Float32)
    x.store(piece.load().to(Float32))
    squares = Float32(0.0)
    for j in cutlass.range_constexpr(LANES):
        squares = squares + x[j] * x[j]
    for step in cutlass.range_constexpr(GROUPS.bit_length() - 1):
        squares = squares + cute.arch.shuffle_sync_bfly(squares, offset=1 << step)
    factor = cute.math.rsqrt(squares + Float32(L2_EPS))
    for j in cutlass.range_constexpr(LANES):
        x[j] = x[j] * factor
    piece.store(x.load().to(BFloat16))


def region_bytes(passes: int = 3):
    """(right image [160, K 128], R^T images [2 x 128, K 64], the region) in bytes for `passes`
    (wgmma.image_k). The region holds the right image for the products; then kk, the block
    scratch and qk (then T^-1); then, once T^-1 is in registers, the R^T images; then W and U
    on their way out."""
    right = PACKED * image_k(HEAD_DIM, passes) * 2
    rt = 2 * HEAD_DIM * image_k(ROWS, passes) * 2
    return right, rt, max(right, rt, QK_OFFSET + PAIR_BYTES, 2 * STAGE_BYTES)


def shared_bytes(passes: int) -> int:
    """Shared memory of one CTA (the region first, 1024-aligned, then q, k, Gamma, beta, a
    flag)."""
    return region_bytes(passes)[2] + ROWS * PADDED_ROW * (2 + 2 + 4) + ROWS * 4 + 16


PHASES = (
    "loads, cumsum",
    "anchors, right factors",
    "kk/qk operand and product, first K half",
    "kk/qk operand and product, second K half",
    "kk and qk into shared memory",
    "diagonal blocks pair by pair",
    "Aqk and kk out",
    "v loads, diagonal inverses",
    "blocks below the diagonal",
    "T^-1 out and into registers",
    "R^T images",
    "W and U products",
    "stores",
)
"""The chunk core's phases, in order, each ending at a barrier (the diagonal blocks' only where
a block takes them; the kk/qk halves at thread 0's wait for its warpgroup's product; the last
at thread 0's last store): what the stamps variant (ChunkOperandsConfig.stamps) times. Stores
are timed as issued, not as drained. (H100, 2026-12-06, nine phases then: the loads, kk/qk and
T^-1 took 60-70% of a CTA; benchmarks/README.md.)"""
STAMPS = ("start", *(f"after {phase}" for phase in PHASES), "timer at start", "timer at end")
"""What the stamps variant writes for each CTA (int32): thread 0's cycle counter (the 32-bit
clock, raw: the reader subtracts the start, modulo 2^32, so that no register holds it across
the kernel) at the start and after each phase; then the global timer's low 32 bits (ns) at
the CTA's start and end."""


@dataclasses.dataclass(frozen=True)
class ChunkOperandsConfig:
    scale: float
    passes: int = 3  # bf16 passes a product: 3 (bf16x3) or 1
    residuals: bool = True  # store gamma, kk and tinv (the backward's); False: a forward alone
    # with residuals, store gamma too (False: the fused decayed and tokens' backward, which sums
    # g into Gamma itself, is the only reader; 32 KiB a slot and head less to write and to keep
    # for the backward; the result stays in the artifact's signature, unwritten)
    gamma: bool = True
    images: bool = False  # qg and attn in the scan's operand order (flat [slots, H, 64 * n])
    prep: InputPrep | None = None  # the inputs prepared in the kernel (None: as given)
    stamps: bool = False  # a diagnostic: each CTA's phase clocks (STAMPS) into one more result


class ChunkOperandsSm90:
    def __init__(self, config: ChunkOperandsConfig):
        self.scale = float(config.scale)
        image_k(1, config.passes)  # 1 or 3
        self.passes = config.passes
        self.residuals = config.residuals
        self.gamma = config.gamma
        self.images = config.images
        self.prep = config.prep if config.prep is not None else InputPrep()
        self.stamps = config.stamps

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        g: cute.Tensor,
        beta: cute.Tensor,
        cu_seqlens: cute.Tensor,
        u: cute.Tensor,
        qg: cute.Tensor,
        attn: cute.Tensor,
        decay: cute.Tensor,
        gamma: cute.Tensor,
        kk: cute.Tensor,
        tinv: cute.Tensor,
        w_img: cute.Tensor,
        kd_img: cute.Tensor,
        stream: cuda.CUstream,
    ):
        self.launch(
            q, k, v, g, beta, cu_seqlens, u, qg, attn, decay, gamma, kk, tinv, w_img, kd_img,
            None, None, None, stream,
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
        u: cute.Tensor,
        qg: cute.Tensor,
        attn: cute.Tensor,
        decay: cute.Tensor,
        gamma: cute.Tensor,
        kk: cute.Tensor,
        tinv: cute.Tensor,
        w_img: cute.Tensor,
        kd_img: cute.Tensor,
        a_log: cute.Tensor | None,
        dt_bias: cute.Tensor | None,
        stamps: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        n_slots = u.shape[0]
        heads = u.shape[1]
        rmem = warpgroup.OperandSource.RMEM
        mma_pairs = bf16_tiled_mma((ROWS, PACKED), rmem)
        mma_solve = bf16_tiled_mma((ROWS, HEAD_DIM), rmem, b_mn_major=True)  # R^T by channel
        # Two CTAs an SM at one pass (registers capped at 128 a thread); at three the operands
        # take twice the registers and shared memory, one CTA an SM.
        per_sm = 2 if cutlass.const_expr(self.passes == 1) else 1
        self.kernel(
            q, k, v, g, beta, cu_seqlens, u, qg, attn, decay, gamma, kk, tinv, w_img, kd_img,
            mma_pairs, mma_solve, a_log, dt_bias, stamps,
        ).launch(
            grid=[n_slots, heads, 1], block=[NTHREADS, 1, 1], stream=stream,
            min_blocks_per_mp=per_sm, preferred_smem_carveout=100,
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
        mU: cute.Tensor,
        mQg: cute.Tensor,
        mAttn: cute.Tensor,
        mDecay: cute.Tensor,
        mGamma: cute.Tensor,
        mKK: cute.Tensor,
        mTinv: cute.Tensor,
        mWImg: cute.Tensor,
        mKdImg: cute.Tensor,
        mma_pairs: cute.TiledMma,
        mma_solve: cute.TiledMma,
        mALog: cute.Tensor | None = None,
        mDtBias: cute.Tensor | None = None,
        mStamps: cute.Tensor | None = None,
    ):
        tid, _, _ = cute.arch.thread_idx()
        slot, h, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.stamps):
            if tid == 0:
                mStamps[slot, h, len(STAMPS) - 2] = cute.arch.globaltimer_lo()
                mStamps[slot, h, 0] = cute.arch.clock()
        d = tid % 128  # channel in the row-split phases; the thread's slice in the products
        part = tid // 128  # warpgroup
        scale = self.scale
        passes = self.passes
        _, rt_bytes, region = region_bytes(passes)

        smem = SmemAllocator()
        padded = cute.make_layout((ROWS, HEAD_DIM), stride=(PADDED_ROW, 1))
        s_region = smem.allocate_tensor(
            Int32, cute.make_layout(region // 4), 1024
        )  # the operand images and pair matrices, reused
        s_q = smem.allocate_tensor(BFloat16, padded, 16)
        s_k = smem.allocate_tensor(BFloat16, padded, 16)
        s_gam = smem.allocate_tensor(Float32, padded, 16)
        s_beta = smem.allocate_tensor(Float32, cute.make_layout(ROWS), 16)
        s_flag = smem.allocate_tensor(Int32, cute.make_layout(1), 4)

        raw = s_region.iterator
        pairs = cute.make_layout((ROWS, ROWS), stride=(PAIR_ROW, 1))
        s_right = view(raw, 0, image_layout(PACKED, image_k(HEAD_DIM, passes)))
        s_kk = cute.make_tensor(cute.recast_ptr(raw, dtype=Float32), pairs)
        s_m = cute.make_tensor(
            cute.recast_ptr(raw + PAIR_BYTES // 4, dtype=Float32),
            cute.make_layout((BLOCKS - 1, BLOCK, BLOCK), stride=(BLOCK * 17, 17, 1)),
        )
        rt_half = image_layout(HEAD_DIM, image_k(ROWS, passes), mn_major=True)
        s_rt_w = view(raw, 0, rt_half)
        s_rt_u = view(raw, rt_bytes // 2, rt_half)
        s_qk = cute.make_tensor(cute.recast_ptr(raw + QK_OFFSET // 4, dtype=Float32), pairs)
        s_tinv = s_qk  # after qk is out
        staged = cute.make_layout((ROWS, HEAD_DIM), stride=(PADDED_ROW, 1))
        s_stage_w = cute.make_tensor(cute.recast_ptr(raw, dtype=BFloat16), staged)  # after W U
        s_stage_u = cute.make_tensor(
            cute.recast_ptr(raw + STAGE_BYTES // 4, dtype=BFloat16), staged
        )

        active, bos, seqlen, c = slot_owner(mCu, slot, SCAN_CHUNK)
        tokens = mQ.shape[0]
        h_qk = h  # the q and k head this value head reads
        if cutlass.const_expr(self.prep.grouped_qk):
            h_qk = h // (mU.shape[1] // mQ.shape[1])

        # ---- the chunk into shared memory, 16 bytes a thread a load (g four channels, q and k
        # eight), every load issued before the first store; rows past the end zero and gates
        # below the floor taken as it. The loads are unconditional (rows clamped into the
        # tensor, zeroed afterwards) so that a thread's are all in flight together. Then Gamma =
        # cumsum g: thread (part, d) sums channel d over rows [HALF part, HALF (part + 1)).
        if tid == 0:
            s_flag[0] = Int32(0)
        row_base = bos + c * ROWS
        last_ok = cutlass.min(bos + seqlen, tokens) - 1  # the last row this slot may read
        rows_ok = Int32(0)  # rows of the chunk inside its sequence
        if active:
            rows_ok = cutlass.max(cutlass.min(seqlen - c * ROWS, ROWS), 0)
        r_g = cute.make_rmem_tensor((G_PIECES, 4), Float32)
        r_q = cute.make_rmem_tensor((TASKS, LANES), BFloat16)
        r_k = cute.make_rmem_tensor((TASKS, LANES), BFloat16)
        r_g.fill(0.0)
        r_q.fill(0.0)
        r_k.fill(0.0)
        if tokens > 0:  # every sequence empty: slots but no rows to read
            for m in cutlass.range_constexpr(G_PIECES):
                pos = (m * NTHREADS + tid) * 4
                token = cutlass.max(cutlass.min(row_base + pos // HEAD_DIM, last_ok), 0)
                r_g[m, None].store(vec4(mG[token, h, None].iterator + pos % HEAD_DIM).load())
            for m in cutlass.range_constexpr(TASKS):
                pos = (m * NTHREADS + tid) * LANES
                token = cutlass.max(cutlass.min(row_base + pos // HEAD_DIM, last_ok), 0)
                r_q[m, None].store(row_piece(mQ[token, h_qk, None], pos % HEAD_DIM, LANES).load())
                r_k[m, None].store(row_piece(mK[token, h_qk, None], pos % HEAD_DIM, LANES).load())
        if d < HALF:  # beta: one row a thread, clamped into the tensor like the loads above
            b_row = Float32(0.0)
            if tokens > 0 and part * HALF + d < rows_ok:
                b_row = mBeta[cutlass.max(cutlass.min(row_base + part * HALF + d, last_ok), 0), h]
                if cutlass.const_expr(self.prep.beta_logits):
                    b_row = Float32(1.0) / (Float32(1.0) + cute.math.exp(-b_row))
            s_beta[part * HALF + d] = b_row
        r_bias = cute.make_rmem_tensor((4,), Float32)  # the in-kernel gate's dt_bias, amplitude
        amplitude = Float32(1.0)
        if cutlass.const_expr(self.prep.gate):
            # every piece of this thread's is at the same four channels (NTHREADS * 4 is a
            # whole number of rows)
            r_bias.store(vec4(mDtBias[h, None].iterator + (tid * 4) % HEAD_DIM).load())
            amplitude = cute.math.exp(mALog[h])
        for m in cutlass.range_constexpr(G_PIECES):
            pos = (m * NTHREADS + tid) * 4
            i = pos // HEAD_DIM
            four = cute.make_rmem_tensor((4,), Float32)
            four.fill(0.0)
            if i < rows_ok:
                for x in cutlass.range_constexpr(4):
                    gv = r_g[m, x]
                    if cutlass.const_expr(self.prep.gate):
                        gv = kda_gate(gv + r_bias[x], amplitude, self.prep.lower_bound)
                    if gv < Float32(GATE_FLOOR):  # as xla.py: g = -inf resets; NaN stays NaN
                        gv = Float32(GATE_FLOOR)
                    four[x] = gv
            vec4(s_gam[i, None].iterator + pos % HEAD_DIM).store(four.load())
        for m in cutlass.range_constexpr(TASKS):
            pos = (m * NTHREADS + tid) * LANES
            i = pos // HEAD_DIM
            if cutlass.const_expr(self.prep.qk_l2norm):  # every lane, before any zeroing
                l2_normalize_row_piece(r_q[m, None])
                l2_normalize_row_piece(r_k[m, None])
            if i >= rows_ok:
                r_q[m, None].fill(0.0)
                r_k[m, None].fill(0.0)
            row_piece(s_q[i, None], pos % HEAD_DIM, LANES).store(r_q[m, None].load())
            row_piece(s_k[i, None], pos % HEAD_DIM, LANES).store(r_k[m, None].load())
        cute.arch.sync_threads()
        # the chunk's v rows into L2 (prefetch.py) while the cumsum, the anchors and the kk/qk
        # products run, once the first loads are in: they load after T^-1's diagonal blocks
        # (the rows as slot_rows bounds them: inside the tensor whatever cu_seqlens holds)
        v_row0, v_count = slot_rows(mCu, slot, tokens, SCAN_CHUNK)
        v_bytes = HEAD_DIM * mV.element_type.width // 8
        prefetch_rows(((mV[None, h, None], 0, v_bytes),), v_row0, v_count, tid, NTHREADS)
        r_run = cute.make_rmem_tensor((HALF,), Float32)
        for r in cutlass.range_constexpr(HALF):
            r_run[r] = s_gam[part * HALF + r, d]
        gam = Float32(0.0)  # this warpgroup's rows' partial sum
        for r in cutlass.range_constexpr(HALF):
            gam = gam + r_run[r]
            s_gam[part * HALF + r, d] = gam
        cute.arch.sync_threads()
        # the later warpgroups' partial sums start from the rows before theirs
        g_before = Float32(0.0)
        for prev in cutlass.range_constexpr(1, WGS):
            if part >= prev:
                g_before = g_before + s_gam[prev * HALF - 1, d]
        cute.arch.sync_threads()  # every g_before read before any fix-up (WGS > 2)
        if part > 0:
            for r in cutlass.range_constexpr(HALF):
                s_gam[part * HALF + r, d] = s_gam[part * HALF + r, d] + g_before
        cute.arch.sync_threads()
        self.stamp(mStamps, slot, h, 1, tid)

        # ---- middle-row anchors where the decay allows, else first-row ones (chunk64.py)
        pairwise, shift = choose_anchors(s_gam, s_flag, d)
        # ---- the right operand: every anchor's factors, packed (chunk64.py)
        put_right_factors(s_right, s_k, s_gam, tid, shift, pairwise, False, passes)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()
        self.stamp(mStamps, slot, h, 2, tid)

        # ---- kk (warpgroup 0) and qk (warpgroup 1) at once: the left operand, k or q anchored
        # at its block's anchor, in registers at the product's A coordinates (one warpgroup's C
        # and A layouts are the same), x the packed right factors
        mma_pairs.set(warpgroup.Field.ACCUMULATE, True)
        mma_solve.set(warpgroup.Field.ACCUMULATE, True)
        thr = mma_pairs.get_slice(d)
        f_right = mma_pairs.make_fragment_B(thr.partition_B(s_right))
        c_pairs = thr.partition_C(cute.make_identity_tensor((ROWS, PACKED)))
        acc = cute.make_rmem_tensor(mma_pairs.partition_shape_C((ROWS, PACKED)), Float32)
        acc.fill(0.0)
        # K (the channels) in two halves, each built and issued before the next is built: at
        # one pass the whole operand and the accumulator would pass 128 registers a thread
        # (ptxas then serialises the wgmma)
        k_half = HEAD_DIM // 2
        coords = bf16_tiled_mma((ROWS, k_half), warpgroup.OperandSource.RMEM).get_slice(d)
        c_left = coords.partition_C(cute.make_identity_tensor((ROWS, k_half)))
        for kh in cutlass.range_constexpr(2):
            # float32 at three passes (split below), else bf16 straight into the A fragment
            a_op = mma_pairs.make_fragment_A(mma_pairs.partition_shape_A((ROWS, k_half)))
            left = cute.make_tensor(a_op.iterator, cute.make_layout(c_left.shape))
            if cutlass.const_expr(passes == 3):
                left = cute.make_rmem_tensor(c_left.shape, Float32)
            if part == 0:
                self.anchored_pairs(left, c_left, kh * k_half, shift, s_k, s_gam)
            else:
                self.anchored_pairs(left, c_left, kh * k_half, shift, s_q, s_gam)
            a_hi = a_op
            a_lo = a_op
            if cutlass.const_expr(passes == 3):
                a_hi, a_lo = split_a_operands(mma_pairs, left, ROWS, k_half)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range_constexpr(k_half // 16):
                kb_b = kh * (k_half // 16) + kb  # the right image's K-block
                cute.gemm(mma_pairs, acc, a_hi[None, None, kb], f_right[None, None, kb_b], acc)
                if cutlass.const_expr(passes == 3):
                    cute.gemm(mma_pairs, acc, a_lo[None, None, kb], f_right[None, None, kb_b], acc)
                    cute.gemm(
                        mma_pairs, acc, a_hi[None, None, kb],
                        f_right[None, None, HEAD_DIM // 16 + kb_b], acc,
                    )  # fmt: skip
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(0)
            self.stamp(mStamps, slot, h, 3 + kh, tid)
        cute.arch.sync_threads()  # both products done reading the right image (the pairs' space)
        for e in cutlass.range_constexpr(cute.size(acc)):
            i, p = c_pairs[e]
            b, j = packed_row(p)
            if i // BLOCK == b and j <= i:
                if j < BLOCK * b or pairwise == Int32(0):
                    if part == 0:
                        s_kk[i, j] = acc[e]
                    else:
                        s_qk[i, j] = acc[e]
        cute.arch.sync_threads()
        self.stamp(mStamps, slot, h, 5, tid)

        # ---- the diagonal blocks pair by pair where a block's decay range is not safe
        if pairwise != Int32(0):
            warp = tid // 32
            lane = tid % 32
            for pi in cutlass.range(warp, BLOCKS * BLOCK * BLOCK, WARPS, unroll=1):
                b = pi // (BLOCK * BLOCK)
                i = BLOCK * b + (pi // BLOCK) % BLOCK
                j = BLOCK * b + pi % BLOCK
                if j <= i:
                    part_kk = Float32(0.0)
                    part_qk = Float32(0.0)
                    for t in cutlass.range_constexpr(HEAD_DIM // 32):
                        chan = lane + 32 * t
                        e = exp_fast(s_gam[i, chan] - s_gam[j, chan])
                        kj_e = Float32(s_k[j, chan]) * e
                        part_kk = part_kk + Float32(s_k[i, chan]) * kj_e
                        part_qk = part_qk + Float32(s_q[i, chan]) * kj_e
                    for offset in cutlass.range_constexpr(5):
                        part_kk = part_kk + cute.arch.shuffle_sync_bfly(part_kk, 16 >> offset)
                        part_qk = part_qk + cute.arch.shuffle_sync_bfly(part_qk, 16 >> offset)
                    if lane == 0:
                        s_kk[i, j] = part_kk
                        s_qk[i, j] = part_qk
            cute.arch.sync_threads()
        self.stamp(mStamps, slot, h, 6, tid)

        # ---- Aqk (bf16) and kk (float32) out (zero above the diagonal), coalesced; a thread
        # takes eight neighbouring columns, 16 bytes a store
        a_eight = cute.make_rmem_tensor((LANES,), BFloat16)
        k_four = cute.make_rmem_tensor((2, 4), Float32)
        for it in cutlass.range_constexpr(ROWS * ROWS // (LANES * NTHREADS)):
            e_idx = LANES * (tid + it * NTHREADS)
            i = e_idx // ROWS
            for x in cutlass.range_constexpr(LANES):
                j = e_idx % ROWS + x
                a_ij = Float32(0.0)
                k_ij = Float32(0.0)
                if j <= i:
                    a_ij = scale * s_qk[i, j]
                    k_ij = s_kk[i, j]
                a_eight[x] = a_ij.to(BFloat16)
                k_four[x // 4, x % 4] = k_ij
            if cutlass.const_expr(self.images):  # Aqk's K-major operand image, as W's
                at = row_piece(mAttn[slot, h, None], scan_order_offset(i, e_idx % ROWS), LANES)
                at.store(a_eight.load())
            else:
                row_piece(mAttn[slot, h, i, None], e_idx % ROWS, LANES).store(a_eight.load())
            if cutlass.const_expr(self.residuals):
                for q4 in cutlass.range_constexpr(2):
                    vec4(mKK[slot, h, i, None].iterator + e_idx % ROWS + 4 * q4).store(
                        k_four[q4, None].load()
                    )
        cute.arch.sync_threads()  # s_qk is T^-1 from here
        self.stamp(mStamps, slot, h, 7, tid)

        # v loads now, in registers, so the T^-1 phase hides them: thread (row group, channel
        # group) takes channels c8 .. c8 + 7 of rows r8 + 16 m (VEC_ROWS = 16), 16 bytes a load
        c8 = LANES * (tid % GROUPS)
        r8 = tid // GROUPS
        r_v = cute.make_rmem_tensor((TASKS, LANES), BFloat16)
        for m in cutlass.range_constexpr(TASKS):
            r_v[m, None].fill(0.0)
        if tokens > 0:
            for m in cutlass.range_constexpr(TASKS):
                token = cutlass.max(cutlass.min(bos + c * ROWS + r8 + VEC_ROWS * m, last_ok), 0)
                r_v[m, None].store(row_piece(mV[token, h, None], c8, LANES).load())
        for m in cutlass.range_constexpr(TASKS):
            if not (active and c * ROWS + r8 + VEC_ROWS * m < seqlen):
                r_v[m, None].fill(0.0)

        # ---- T^-1, T = I + strictLower(beta_i kk_ij), float32 by 16-row blocks (chunk64.py)
        diagonal_inverses(s_kk, s_beta, s_tinv, tid, NTHREADS)
        self.stamp(mStamps, slot, h, 8, tid)
        below_diagonal_blocks(s_kk, s_beta, s_tinv, s_m, tid, NTHREADS)
        self.stamp(mStamps, slot, h, 9, tid)

        # ---- T^-1 out, and into registers as the solve's A operand (warpgroup 0: W, 1: U)
        if cutlass.const_expr(self.residuals):
            for it in cutlass.range_constexpr(ROWS * ROWS // (LANES * NTHREADS)):
                e_idx = LANES * (tid + it * NTHREADS)  # bf16: the backward's solve is one product
                i = e_idx // ROWS
                for x in cutlass.range_constexpr(LANES):
                    a_eight[x] = s_tinv[i, e_idx % ROWS + x].to(BFloat16)
                row_piece(mTinv[slot, h, i, None], e_idx % ROWS, LANES).store(a_eight.load())
        thr_s = mma_solve.get_slice(d)
        coords_t = bf16_tiled_mma((ROWS, ROWS), warpgroup.OperandSource.RMEM).get_slice(d)
        c_t = coords_t.partition_C(cute.make_identity_tensor((ROWS, ROWS)))
        t_op = mma_solve.make_fragment_A(mma_solve.partition_shape_A((ROWS, ROWS)))
        t_vals = cute.make_tensor(t_op.iterator, cute.make_layout(c_t.shape))
        if cutlass.const_expr(passes == 3):
            t_vals = cute.make_rmem_tensor(c_t.shape, Float32)
        for e in cutlass.range_constexpr(cute.size(t_vals)):
            i, j = c_t[e]
            if cutlass.const_expr(passes == 3):
                t_vals[e] = s_tinv[i, j]
            else:
                t_vals[e] = s_tinv[i, j].to(BFloat16)
        t_hi = t_op
        t_lo = t_op
        if cutlass.const_expr(passes == 3):
            t_hi, t_lo = split_a_operands(mma_solve, t_vals, ROWS, ROWS)
        cute.arch.sync_threads()  # T^-1 read: the region is free for R^T
        self.stamp(mStamps, slot, h, 10, tid)

        # ---- the solve's B images R^T (rows = the 256 columns [beta k exp(Gamma) | beta v],
        # K = token): 8 channels of one token a store
        for m in cutlass.range_constexpr(TASKS):
            t = r8 + VEC_ROWS * m
            b_t = s_beta[t]
            e_t = exp_fast(load_f32(s_gam[t, None], c8, LANES))
            r_kt = load_f32(s_k[t, None], c8, LANES) * b_t * e_t
            put_piece(s_rt_w, c8, t, r_kt, True, ROWS, passes)
            put_piece(s_rt_u, c8, t, r_v[m, None].load().to(Float32) * b_t, True, ROWS, passes)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()
        self.stamp(mStamps, slot, h, 11, tid)

        # ---- W (warpgroup 0) and U (warpgroup 1) = T^-1 R on tensor cores
        f_rt_w = mma_solve.make_fragment_B(thr_s.partition_B(s_rt_w))
        f_rt_u = mma_solve.make_fragment_B(thr_s.partition_B(s_rt_u))
        c_solve = thr_s.partition_C(cute.make_identity_tensor((ROWS, HEAD_DIM)))
        acc_s = cute.make_rmem_tensor(mma_solve.partition_shape_C((ROWS, HEAD_DIM)), Float32)
        if cutlass.const_expr(passes == 3):
            acc_s.fill(0.0)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range_constexpr(ROWS // 16):
                if part == 0:
                    cute.gemm(mma_solve, acc_s, t_hi[None, None, kb], f_rt_w[None, None, kb], acc_s)
                    cute.gemm(mma_solve, acc_s, t_lo[None, None, kb], f_rt_w[None, None, kb], acc_s)
                    cute.gemm(
                        mma_solve, acc_s, t_hi[None, None, kb],
                        f_rt_w[None, None, ROWS // 16 + kb], acc_s,
                    )  # fmt: skip
                else:
                    cute.gemm(mma_solve, acc_s, t_hi[None, None, kb], f_rt_u[None, None, kb], acc_s)
                    cute.gemm(mma_solve, acc_s, t_lo[None, None, kb], f_rt_u[None, None, kb], acc_s)
                    cute.gemm(
                        mma_solve, acc_s, t_hi[None, None, kb],
                        f_rt_u[None, None, ROWS // 16 + kb], acc_s,
                    )  # fmt: skip
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(0)
        else:
            if part == 0:
                product_passes(mma_solve, acc_s, t_op, f_rt_w, ROWS // 16, False, 1)
            else:
                product_passes(mma_solve, acc_s, t_op, f_rt_u, ROWS // 16, False, 1)
        # ---- out through shared memory: W and U as bf16 into row-major stages (the R^T images
        # are read: the region is free), then every output 16 bytes a store, thread (r8, c8)'s
        # rows and channels: W into the scan's image, U, Qg, Kd's image (and Gamma) row-major
        cute.arch.sync_threads()
        self.stamp(mStamps, slot, h, 12, tid)
        pair = cute.make_rmem_tensor((2,), Float32)
        for e in cutlass.range_constexpr(0, cute.size(acc_s), 2):
            i, n = c_solve[e]
            pair[0] = acc_s[e]
            pair[1] = acc_s[e + 1]
            if part == 0:
                pair_at(s_stage_w[i, None], n).store(pair.load().to(BFloat16))
            else:
                pair_at(s_stage_u[i, None], n).store(pair.load().to(BFloat16))
        cute.arch.sync_threads()
        gam_last = load_f32(s_gam[ROWS - 1, None], c8, LANES)
        for m in cutlass.range_constexpr(TASKS):
            t = r8 + VEC_ROWS * m
            row_piece(mWImg[slot, h, None], scan_order_offset(t, c8), LANES).store(
                row_piece(s_stage_w[t, None], c8, LANES).load()
            )
            row_piece(mU[slot, h, t, None], c8, LANES).store(
                row_piece(s_stage_u[t, None], c8, LANES).load()
            )
            gam_t = load_f32(s_gam[t, None], c8, LANES)
            qg_t = load_f32(s_q[t, None], c8, LANES) * Float32(scale) * exp_fast(gam_t)
            if cutlass.const_expr(self.images):  # Qg's K-major operand image, as W's
                qg_at = row_piece(mQg[slot, h, None], scan_order_offset(t, c8), LANES)
                qg_at.store(qg_t.to(BFloat16))
            else:
                row_piece(mQg[slot, h, t, None], c8, LANES).store(qg_t.to(BFloat16))
            kd_t = load_f32(s_k[t, None], c8, LANES) * exp_fast(gam_last - gam_t)
            kd_at = row_piece(mKdImg[slot, h, None], scan_order_offset(t, c8), LANES)
            kd_at.store(kd_t.to(BFloat16))
            if cutlass.const_expr(self.residuals and self.gamma):
                for q4 in cutlass.range_constexpr(LANES // 4):
                    vec4(mGamma[slot, h, t, None].iterator + c8 + 4 * q4).store(
                        load_f32(s_gam[t, None], c8 + 4 * q4, 4)
                    )
        if part == 0:
            mDecay[slot, h, d] = exp_fast(s_gam[ROWS - 1, d])
        self.stamp(mStamps, slot, h, 13, tid)
        if cutlass.const_expr(self.stamps):
            if tid == 0:
                mStamps[slot, h, len(STAMPS) - 1] = cute.arch.globaltimer_lo()

    @cute.jit
    def anchored_pairs(self, left, c_left, ch_off, shift, s_x, s_gam):
        """The kk/qk left operand (s_x: k for warpgroup 0, q for 1; anchored at its block's
        anchor row) into `left` (the A fragment's values, compact: bf16 at one pass, else
        float32), two channels a load: elements e and e + 1 of a wgmma fragment
        are channels ch and ch + 1 of one row, so k or q comes 4 bytes and Gamma 8 bytes a
        load, against the scalar load an element it replaced (the same arithmetic)."""
        for e in cutlass.range_constexpr(0, cute.size(left), 2):
            i, ch0 = c_left[e]
            ch = ch0 + ch_off
            anchor_row = (i // BLOCK) * BLOCK + shift
            x = pair_at(s_x[i, None], ch).load().to(Float32)
            gam_i = pair_at(s_gam[i, None], ch).load()
            gam_anchor = pair_at(s_gam[anchor_row, None], ch).load()
            y = x * exp_fast(gam_i - gam_anchor)
            two = cute.make_tensor(left.iterator + e, cute.make_layout(2))
            if cutlass.const_expr(self.passes == 3):
                two.store(y)
            else:
                two.store(y.to(BFloat16))

    @cute.jit
    def stamp(self, mStamps, slot, h, index: cutlass.Constexpr[int], tid):
        """The stamps variant's clock after a phase (thread 0's, raw): STAMPS."""
        if cutlass.const_expr(self.stamps):
            if tid == 0:
                mStamps[slot, h, index] = cute.arch.clock()


class ChunkOperandsGateSm90(ChunkOperandsSm90):
    """The chunk core with the gate made in the kernel (InputPrep.gate): g is the raw gate
    projection a, and a_log [HV] and dt_bias [HV, 128] (float32, per value head) come after
    cu_seqlens."""

    def __init__(self, config: ChunkOperandsConfig):
        super().__init__(config)
        if not self.prep.gate:
            raise ValueError("ChunkOperandsGateSm90 is the variant with InputPrep(gate=True)")

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
        u: cute.Tensor,
        qg: cute.Tensor,
        attn: cute.Tensor,
        decay: cute.Tensor,
        gamma: cute.Tensor,
        kk: cute.Tensor,
        tinv: cute.Tensor,
        w_img: cute.Tensor,
        kd_img: cute.Tensor,
        stream: cuda.CUstream,
    ):
        self.launch(
            q, k, v, g, beta, cu_seqlens, u, qg, attn, decay, gamma, kk, tinv, w_img, kd_img,
            a_log, dt_bias, None, stream,
        )  # fmt: skip


class ChunkOperandsStampsSm90(ChunkOperandsSm90):
    """The chunk core's stamps variant (ChunkOperandsConfig.stamps, a diagnostic): one more
    result after kd_img, stamps int32 [slots, H, len(STAMPS)]."""

    def __init__(self, config: ChunkOperandsConfig):
        super().__init__(config)
        if not self.stamps or self.prep != InputPrep():
            raise ValueError("ChunkOperandsStampsSm90 is the variant with stamps, without prep")

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        g: cute.Tensor,
        beta: cute.Tensor,
        cu_seqlens: cute.Tensor,
        u: cute.Tensor,
        qg: cute.Tensor,
        attn: cute.Tensor,
        decay: cute.Tensor,
        gamma: cute.Tensor,
        kk: cute.Tensor,
        tinv: cute.Tensor,
        w_img: cute.Tensor,
        kd_img: cute.Tensor,
        stamps: cute.Tensor,
        stream: cuda.CUstream,
    ):
        self.launch(
            q, k, v, g, beta, cu_seqlens, u, qg, attn, decay, gamma, kk, tinv, w_img, kd_img,
            None, None, stamps, stream,
        )  # fmt: skip
