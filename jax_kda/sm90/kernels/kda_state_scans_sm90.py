"""Both state scans of the training backward in one launch, sm_90a CuTe DSL: the forward scan
(the chunk states) and the reverse one (the states' cotangents), each the tensor-core scan of
kda_state_scan_tc_sm90.py (read its docstring), side by side.

The two are independent (the reverse scan's addend comes from the outputs' cotangent, not from
the states), and each is a serial chain that leaves most of an SM idle: in one launch, the
reverse scan's CTAs run beside the forward's instead of after them. Grid (2 x 128 / VS, H, N):
x in [0, 128 / VS) runs the forward direction on state columns x VS.., the rest the reverse one
(the direction in x keeps y and z within CUDA's 65535 as a single scan's grid, and puts a (head,
sequence)'s two directions next to each other in launch order). Each CTA allocates the reverse
direction's shared memory (its addend stages are [128, VS], the forward's [64, VS]).
One bf16 pass a product only: at one pass an operand's image is the same in both roles.

Inputs: the forward scan's (A = W image, B^T = Kd image, decay, the addend U in V slices, or
with plain_addend as the chunk core stores it, bf16 [slots, H, 64 * 128], each CTA copying its
slice by TMA, cu_seqlens, y0) and the reverse scan's (A = Kd image,
B^T = W image, the same decay, the addend dL/dS in V slices, d_final); outputs: the states
entering each chunk and the final states, then the cotangents at each chunk's end and of the
initial states. The initial and final states and their cotangents (y0, final, d_final,
d_y0) are [N, H, K, V], with plain_addend [N, H, V, K] (prefill's layout, so that the
caller's transposes cancel against xla.forward's); the chunk states and their cotangents
[slots, H, K, V] either way. The images are the same two arrays, in swapped roles: the caller
passes them once each.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from jax_kda.constants import HEAD_DIM
from jax_kda.sm90.kernels.kda_state_scan_sm90 import ScanConfig
from jax_kda.sm90.kernels.kda_state_scan_tc_sm90 import (
    NTHREADS,
    ChunkStateScanTcSm90,
    accumulate_always,
    scan_mmas,
    u_tma,
)


class BothStateScansSm90:
    def __init__(self, v_slice: int, passes: int = 1, plain_addend: bool = False):
        if passes != 1:
            raise ValueError(
                "both scans in one launch take one bf16 pass a product (at three the A and B^T "
                f"images of an operand differ, so one array cannot serve both roles); got {passes}"
            )
        self.vs = v_slice
        self.forward = ChunkStateScanTcSm90(
            ScanConfig(reverse=False, v_slice=v_slice), passes, plain_addend=plain_addend
        )
        self.reverse = ChunkStateScanTcSm90(
            ScanConfig(reverse=True, v_slice=v_slice), passes, state_vk=plain_addend
        )

    @cute.jit
    def __call__(
        self,
        w_img: cute.Tensor,
        kd_img: cute.Tensor,
        decay: cute.Tensor,
        u: cute.Tensor,
        d_states: cute.Tensor,
        cu_seqlens: cute.Tensor,
        y0: cute.Tensor,
        d_final: cute.Tensor,
        states: cute.Tensor,
        final: cute.Tensor,
        g_end: cute.Tensor,
        d_y0: cute.Tensor,
        stream: cuda.CUstream,
    ):
        n_seq = cu_seqlens.shape[0] - 1
        heads = y0.shape[1]
        mma_x, mma_y = scan_mmas(self.vs)
        tma_u = None
        if cutlass.const_expr(self.forward.u_rows):  # U plain: its slices by TMA
            tma_u, u = u_tma(u, self.vs)
        args = (w_img, kd_img, decay, u, d_states, cu_seqlens, y0, d_final)
        grid = [2 * (HEAD_DIM // self.vs), heads, n_seq]
        self.kernel(*args, states, final, g_end, d_y0, mma_x, mma_y, tma_u).launch(
            grid=grid, block=[NTHREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mW: cute.Tensor,
        mKd: cute.Tensor,
        mDecay: cute.Tensor,
        mU: cute.Tensor,
        mDs: cute.Tensor,
        mCu: cute.Tensor,
        mY0: cute.Tensor,
        mDfinal: cute.Tensor,
        mStates: cute.Tensor,
        mFinal: cute.Tensor,
        mGend: cute.Tensor,
        mDy0: cute.Tensor,
        mma_x: cute.TiledMma,
        mma_y: cute.TiledMma,
        tma_u: cute.CopyAtom | None = None,
    ):
        x, h, n = cute.arch.block_idx()
        slices = HEAD_DIM // self.vs
        accumulate_always(mma_x, mma_y)
        # the larger addend stages (the reverse's [128, VS] float32; U's bf16 slice is smaller)
        buffers = self.reverse.allocate(self.reverse.addend_rows)
        if cutlass.const_expr(self.forward.u_rows):  # mU: U's TMA tensor
            mU = (tma_u, mU)
        if x < slices:
            self.forward.scan(mW, mKd, mDecay, mU, mCu, mY0, mStates, mFinal, mma_x, mma_y,
                              buffers, x, h, n)  # fmt: skip
        else:
            self.reverse.scan(mKd, mW, mDecay, mDs, mCu, mDfinal, mGend, mDy0, mma_x, mma_y,
                              buffers, x - slices, h, n)  # fmt: skip
