"""The kernels' layout facts, in plain Python (no CuTe): the plan and the backend read them
from here, the kernels define their buffers from them. One home for each."""

from jax_kda.constants import HEAD_DIM

CHUNK = 16
"""Tokens per chunk of the sm90 forward kernels (the backward's are constants.SCAN_CHUNK). At the
production gate (>= -5 per step) exp(-Gamma) over 16 tokens stays under e^80, inside float32's
range, which is what lets the forward factorise the decay."""

CHUNK_RECORD_BYTES = 21504
"""Bytes PREP writes per (chunk slot, head) for EXPAND: -wt, qg, kg^T (bf16 swizzled wgmma tiles,
4 KiB each), Z (bf16 16x16), a = exp(gamma) (f32 [128]) and ut^T (f32 [128, 16])."""

SCAN_SIMT_V_SLICES = (16, 32)
"""State columns one CTA of the SIMT state scan may own (kda_state_scan_sm90.py)."""

SCAN_WGMMA_V_SLICE = 64
"""State columns one CTA of the m64 wgmma state scan owns (kda_state_scan_wgmma_sm90.py, the state
as register-A operand; a profiling variant): the M of its wgmma products."""

SCAN_TC_V_SLICES = (16, 32)
"""State columns one CTA of the tensor-core state scan with the slice as wgmma N may own
(kda_state_scan_tc_sm90.py)."""

SCAN_V_SLICES = (*SCAN_SIMT_V_SLICES, SCAN_WGMMA_V_SLICE)
"""Every state-scan variant on float32 operands, by the state columns one CTA owns."""

SCAN_VARIANTS = {
    **{f"v{v}": (v, False) for v in SCAN_V_SLICES},
    **{f"t{v}": (v, True) for v in SCAN_TC_V_SLICES},
}
"""Every state-scan kernel by name: (state columns per CTA, tensor-core scan with the slice as
wgmma N). The names are the kernels' export prefixes' last part and kernel_profile's."""

DECODE_WARPS = 4
"""Warps of one CTA of the decode kernel (kda_decode_sm90.py)."""

DECODE_ROWS_PER_WARP = 8
"""State rows (value channels) one warp of the decode kernel takes, their loads in flight
together."""

DECODE_CTAS_PER_HEAD = HEAD_DIM // (DECODE_WARPS * DECODE_ROWS_PER_WARP)
"""The decode kernel's CTAs per (sequence, value head): its grid's x extent is this times N."""

BF16_STATES = True
"""Whether the training forward's state scan stores the chunk states (the state entering each
slot: the dense backward's S, the chunk outputs kernel's, and the largest saved residual) in
bf16: the value its products take already (one bf16 pass), so that only the dense backward's
d_decay = rowsum(S * G) sees the rounding (benchmarks.precision_study --storage: worst
rms_ratio 4.3e-3 -> 5.1e-3, dg of a pinned 257-token call; SPEC's bar 1e-2). Half of the
64 KiB a slot and head written, kept and read."""

BF16_ADDEND = True
"""Whether the state cotangent kernel writes the reverse scan's addend (the outputs' part of
each chunk's state cotangent, in the scan's V slices) in bf16, which the reverse scan reads
so (precision_study --storage: d_initial_state 2.6e-3 -> 3.0e-3 at most, the other gradients
as before). Half of the 64 KiB a slot and head written and read."""
