"""The chunk-state scan of the backward pass, sm_90a CuTe DSL: the serial part of the training
step, both directions in one kernel class.

The chunked form (64-token chunks, the XLA path's slot layout: sequence s owns chunk slots
cu[s]//64 + s + c) makes each chunk an affine map of the state Y = S, [K, V], K-major:

  forward:  states[c] = Y;  X = P_c - W_c Y;   Y = Diag(a_c) Y + Kd_c^T X
  reverse:  states[c] = Y;  X = Kd_c Y;        Y = Diag(a_c) Y - W_c^T X + Q_c

The forward gives the state at every chunk's start (and the final state); the reverse, run from
the final state's cotangent with Y = dS over the chunks in reverse order, gives the cotangent of
the state at every chunk's end (and of the initial state); everything else of the backward is
parallel over chunks. The columns of Y are independent (every product acts on rows), so a CTA
owns one V-slice of VS columns of one (head, sequence): grid (128 / VS, H, N).

A = W (forward) or Kd (reverse), B the other, both [slots, H, 64, K] float32; `decay` a_c
[slots, H, K]; `addend` P_c = U [slots, H, 64, V] (forward) or Q_c = dstates [slots, H, K, V]
(reverse); y0, final [N, H, K, V]; states [slots, H, K, V]. Gap slots (no chunk of any
sequence) get zero states. An empty sequence passes y0 to final bit-exactly.

Per step, float32 FMAs (no rounding of the state): phase 1 X = A Y (64 x VS x 128) with Y
staged in shared memory, thread tile XI x 4; phase 2 Y update (128 x VS x 64) with X staged,
thread tile 4 x VS/4. The next chunk's A, B, decay and addend are in flight (cp.async, 16-byte
vectors, two stages) while this one is computed.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from jax_kda.constants import HEAD_DIM, SCAN_CHUNK
from jax_kda.sm90.kernels.layout import SCAN_SIMT_V_SLICES, SCAN_V_SLICES
from jax_kda.sm90.kernels.varlen import scan_slots
from jax_kda.sm90.kernels.wgmma import vec4

NTHREADS = 128
A_ROW = HEAD_DIM + 4  # padded row of A in shared memory: phase 1's row reads fall in other banks
STAGES = 2


@dataclasses.dataclass(frozen=True)
class ScanConfig:
    reverse: bool
    v_slice: int = 32

    def __post_init__(self):
        if self.v_slice not in SCAN_V_SLICES:
            raise ValueError(f"v_slice must be one of {SCAN_V_SLICES}, got {self.v_slice}")

    @property
    def addend_rows(self) -> int:
        """Rows of the addend per slot: P_c (64 tokens) forward, Q_c (128 K rows) reverse."""
        return HEAD_DIM if self.reverse else SCAN_CHUNK


class ChunkStateScanSm90:
    def __init__(self, config: ScanConfig):
        self.reverse = config.reverse
        if config.v_slice not in SCAN_SIMT_V_SLICES:
            raise ValueError(f"the SIMT scan owns 16 or 32 state columns, got {config.v_slice}")
        self.vs = config.v_slice
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
        self.kernel(a_op, b_op, decay, addend, cu_seqlens, y0, states, final).launch(
            grid=[HEAD_DIM // self.vs, heads, n_seq], block=[NTHREADS, 1, 1], stream=stream
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
    ):
        VS = self.vs
        XI = VS // 8  # phase 1: rows of X per thread (4 columns each)
        XG = VS // 4  # phase 1: column groups
        YV = VS // 4  # phase 2: columns of Y per thread (4 rows each)
        ADD_ROWS = self.addend_rows
        tid, _, _ = cute.arch.thread_idx()
        vsl, h, n = cute.arch.block_idx()
        vbase = vsl * VS
        n_slots = mStates.shape[0]
        sign_a = Float32(1.0) if cutlass.const_expr(self.reverse) else Float32(-1.0)
        sign_b = Float32(-1.0) if cutlass.const_expr(self.reverse) else Float32(1.0)

        smem = SmemAllocator()
        s_a = smem.allocate_tensor(
            Float32,
            cute.make_layout((SCAN_CHUNK, HEAD_DIM, STAGES), stride=(A_ROW, 1, SCAN_CHUNK * A_ROW)),
            16,
        )
        s_b = smem.allocate_tensor(
            Float32,
            cute.make_layout(
                (SCAN_CHUNK, HEAD_DIM, STAGES),
                stride=(HEAD_DIM, 1, SCAN_CHUNK * HEAD_DIM),
            ),
            16,
        )
        s_add = smem.allocate_tensor(
            Float32,
            cute.make_layout((ADD_ROWS, VS, STAGES), stride=(VS, 1, ADD_ROWS * VS)),
            16,
        )
        s_decay = smem.allocate_tensor(
            Float32, cute.make_layout((HEAD_DIM, STAGES), stride=(1, HEAD_DIM)), 16
        )
        s_y = smem.allocate_tensor(Float32, cute.make_layout((HEAD_DIM, VS), stride=(VS, 1)), 16)
        s_x = smem.allocate_tensor(Float32, cute.make_layout((SCAN_CHUNK, VS), stride=(VS, 1)), 16)

        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), Float32, num_bits_per_copy=128
        )

        slot0, nch, gap_end = scan_slots(mCu, n, n_slots, SCAN_CHUNK)

        # phase 2 / register layout of Y: rows 4 * yk + r, columns YV * yq + c
        yk = tid // 4
        yq = tid % 4
        r_y = cute.make_rmem_tensor((4, YV), Float32)
        for r in cutlass.range_constexpr(4):
            for c in cutlass.range_constexpr(YV):
                r_y[r, c] = mY0[n, h, 4 * yk + r, vbase + YV * yq + c]
        # phase 1 layout of X: rows XI * xi + r, columns 4 * xg + c
        xi = tid // XG
        xg = tid % XG

        # prologue: the first chunk in flight (the sequence's last, reversed)
        first_slot = slot0
        if cutlass.const_expr(self.reverse):
            first_slot = slot0 + nch - 1
        if nch > 0:
            self._load_chunk(
                atom, mA, mB, mDecay, mAdd, first_slot, h, vbase, 0, s_a, s_b, s_decay, s_add, tid
            )
        cute.arch.cp_async_commit_group()

        for j in cutlass.range(nch, unroll=1):
            stage = j % STAGES
            slot = slot0 + j
            if cutlass.const_expr(self.reverse):
                slot = slot0 + nch - 1 - j
            if j + 1 < nch:
                nslot = slot + 1
                if cutlass.const_expr(self.reverse):
                    nslot = slot - 1
                self._load_chunk(
                    atom,
                    mA,
                    mB,
                    mDecay,
                    mAdd,
                    nslot,
                    h,
                    vbase,
                    (j + 1) % STAGES,
                    s_a,
                    s_b,
                    s_decay,
                    s_add,
                    tid,
                )
            cute.arch.cp_async_commit_group()

            for r in cutlass.range_constexpr(4):
                row = 4 * yk + r
                for c in cutlass.range_constexpr(YV):
                    mStates[slot, h, row, vbase + YV * yq + c] = r_y[r, c]
                    s_y[row, YV * yq + c] = r_y[r, c]
            cute.arch.cp_async_wait_group(1)  # this thread's part of chunk j landed
            cute.arch.sync_threads()  # chunk j and Y visible to all

            # ---- phase 1: X = (P) + sign_a * A Y
            acc = cute.make_rmem_tensor((XI, 4), Float32)
            for r in cutlass.range_constexpr(XI):
                for c in cutlass.range_constexpr(4):
                    acc[r, c] = Float32(0.0)
                    if cutlass.const_expr(not self.reverse):
                        acc[r, c] = s_add[XI * xi + r, 4 * xg + c, stage]
            for k4 in cutlass.range(HEAD_DIM // 4, unroll=8):
                k = 4 * k4
                a_rows = cute.make_rmem_tensor((XI, 4), Float32)
                y_rows = cute.make_rmem_tensor((4, 4), Float32)
                for r in cutlass.range_constexpr(XI):
                    src = vec4(s_a[XI * xi + r, None, stage].iterator + k)
                    cute.autovec_copy(src, a_rows[r, None])
                for e in cutlass.range_constexpr(4):
                    cute.autovec_copy(vec4(s_y[k + e, None].iterator + 4 * xg), y_rows[e, None])
                for r in cutlass.range_constexpr(XI):
                    for e in cutlass.range_constexpr(4):
                        ae = sign_a * a_rows[r, e]
                        for c in cutlass.range_constexpr(4):
                            acc[r, c] = acc[r, c] + ae * y_rows[e, c]
            for r in cutlass.range_constexpr(XI):
                for c in cutlass.range_constexpr(4):
                    s_x[XI * xi + r, 4 * xg + c] = acc[r, c]
            cute.arch.sync_threads()

            # ---- phase 2: Y = Diag(a) Y + sign_b * B^T X (+ Q)
            for r in cutlass.range_constexpr(4):
                dr = s_decay[4 * yk + r, stage]
                for c in cutlass.range_constexpr(YV):
                    r_y[r, c] = r_y[r, c] * dr
                    if cutlass.const_expr(self.reverse):
                        r_y[r, c] = r_y[r, c] + s_add[4 * yk + r, YV * yq + c, stage]
            for i in cutlass.range(SCAN_CHUNK, unroll=8):
                b_col = cute.make_rmem_tensor((4,), Float32)
                x_row = cute.make_rmem_tensor((YV // 4, 4), Float32)
                cute.autovec_copy(vec4(s_b[i, None, stage].iterator + 4 * yk), b_col)
                for c4 in cutlass.range_constexpr(YV // 4):
                    src = vec4(s_x[i, None].iterator + (YV * yq + 4 * c4))
                    cute.autovec_copy(src, x_row[c4, None])
                for r in cutlass.range_constexpr(4):
                    br = sign_b * b_col[r]
                    for c in cutlass.range_constexpr(YV):
                        r_y[r, c] = r_y[r, c] + br * x_row[c // 4, c % 4]
            cute.arch.sync_threads()  # stage and X free for the next chunk

        cute.arch.cp_async_wait_group(0)
        for r in cutlass.range_constexpr(4):
            for c in cutlass.range_constexpr(YV):
                mFinal[n, h, 4 * yk + r, vbase + YV * yq + c] = r_y[r, c]
        # gap slots after this sequence's chunks: zero states
        for slot in cutlass.range(slot0 + nch, gap_end, unroll=1):
            for r in cutlass.range_constexpr(4):
                for c in cutlass.range_constexpr(YV):
                    mStates[slot, h, 4 * yk + r, vbase + YV * yq + c] = Float32(0.0)

    @cute.jit
    def _load_chunk(
        self, atom, mA, mB, mDecay, mAdd, slot, h, vbase, stage, s_a, s_b, s_decay, s_add, tid
    ):
        """Issue this thread's cp.async copies of one chunk's operands into `stage`."""
        VS = self.vs
        ADD_ROWS = self.addend_rows
        vec_per_row = HEAD_DIM // 4
        for it in cutlass.range_constexpr(SCAN_CHUNK * vec_per_row // NTHREADS):
            idx = tid + it * NTHREADS
            row = idx // vec_per_row
            col = (idx % vec_per_row) * 4
            src = mA[slot, h, row, None].iterator + col
            cute.copy(atom, vec4(src), vec4(s_a[row, None, stage].iterator + col))
            src = mB[slot, h, row, None].iterator + col
            cute.copy(atom, vec4(src), vec4(s_b[row, None, stage].iterator + col))
        add_vec_row = VS // 4
        for it in cutlass.range_constexpr(ADD_ROWS * add_vec_row // NTHREADS):
            idx = tid + it * NTHREADS
            row = idx // add_vec_row
            col = (idx % add_vec_row) * 4
            src = mAdd[slot, h, row, None].iterator + (vbase + col)
            cute.copy(atom, vec4(src), vec4(s_add[row, None, stage].iterator + col))
        if tid < vec_per_row:
            src = mDecay[slot, h, None].iterator + 4 * tid
            cute.copy(atom, vec4(src), vec4(s_decay[None, stage].iterator + 4 * tid))
