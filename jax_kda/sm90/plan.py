"""Static planning of an sm90 prefill call: segments, launches and workspace, from shapes only.

Plain Python (no JAX, no CuTe), so it is unit-tested on any machine and the binding, the tests and
the benchmarks read one answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from jax_kda.constants import HEAD_DIM, SCAN_CHUNK
from jax_kda.sm90.kernels.layout import (
    BF16_ADDEND,
    BF16_STATES,
    CHUNK,
    CHUNK_RECORD_BYTES,
    SCAN_TC_V_SLICES,
)

# The cost model of the serial part, in microseconds, fitted to benchmarks.kernel_profile on the
# H200 (2026-11-30: 1024x4x1, 2048x12x1, 4096x12x1 and 8192x16x1, each cut into 1..16 segments).
CHAIN_STEP_US = 0.57
"""One 16-token chunk of BUILD or EXPAND, one CTA pair per (sequence, head): the serial latency."""
RECORD_STREAM_US = 0.0105
"""Per (chunk, head) record a chain kernel streams when the whole device reads at once (two
17 KiB slab reads at about 3.3 TB/s): the floor once segments are short."""
CHAIN_FIXED_US = 3.0
"""A chain kernel's start and drain."""
COMBINE_FIXED_US = 11.0
COMBINE_STEP_US = 3.1
"""COMBINE: 11 us to start (8 to 13 measured), then 3.1 us a segment boundary."""
LAUNCH_GAP_US = 1.0
"""Idle device time between two of the call's kernels."""

GRID_YZ_LIMIT = 65535
"""CUDA's limit on a grid's y and z extents."""

MAX_SEGMENTS = 16
"""COMBINE walks the segments serially; more than this would make it the critical path."""

CHAIN_CTAS = 2
"""CTAs per (sequence, head) on the chain: each owns 64 of the state's 128 rows."""


@dataclass(frozen=True)
class WorkspaceBuffer:
    """One scratch buffer the custom call asks XLA for, as an extra (dropped) result."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def bytes(self) -> int:
        itemsize = 2 if self.dtype == "bfloat16" else np.dtype(self.dtype).itemsize  # no NumPy bf16
        return math.prod(self.shape) * itemsize


CORE_ROWS = {"u": "bfloat16", "qg": "bfloat16", "gamma": "float32"}
"""The chunk core's [64, 128] results and their dtypes. gamma is an XLA temporary only: the
training path's chunk core leaves it unwritten (the fused decayed and tokens' backward sums g
into it itself), so no call keeps it for its backward."""
CORE_PAIRS = {"attn": "bfloat16", "kk": "float32", "tinv": "bfloat16"}  # its [64, 64] ones
SCAN_IMAGES = ("w", "kd")
"""The chunk core's W and Kd, only as the single-pass scan's bf16 operand images (both
directions' and the other kernels' operand)."""


@dataclass(frozen=True)
class PrefillPlan:
    total_tokens: int
    num_heads: int
    num_sequences: int
    segment_count: int
    """Segments per sequence: 1 means one serial chain per (sequence, head)."""
    launches: int
    """Kernel launches per call."""
    workspace: tuple[WorkspaceBuffer, ...]
    largest_grid_yz: int
    """The largest y or z extent of the call's launches, training included (heads; sequences
    times segments): CUDA allows at most GRID_YZ_LIMIT."""
    backward_buffers: tuple[WorkspaceBuffer, ...]
    """What a training call's backward adds, per 64-token chunk slot and head: the chunk-core
    kernel's results (CORE_ROWS [64, 128]: u, qg bf16, gamma float32, unwritten; CORE_PAIRS
    [64, 64]: attn, tinv bf16, kk float32; decay [128] float32; W and Kd [64, 128] only as the
    bf16 images in the tensor-core state scans' order, which both directions and the other
    kernels read), the scans' addends in V slices (u's forward, float32; the state's cotangent
    from the outputs reverse, bf16 with BF16_ADDEND), and the scans' results, the state
    entering the slot (bf16 with BF16_STATES) and its cotangent at the slot's end (float32).
    XLA temporaries, not residuals: the backward keeps only the inputs and recomputes these."""

    @property
    def workspace_bytes(self) -> int:
        return sum(buffer.bytes for buffer in self.workspace)

    @property
    def backward_bytes(self) -> int:
        return sum(buffer.bytes for buffer in self.backward_buffers)

    @property
    def saved_residual_bytes(self) -> int:
        """What a training call keeps from its forward to its backward with saved residuals
        (prefill's residuals="saved", the default): the chunk core's outputs, its scan images
        and the chunk states, out of backward_buffers (the inputs, kept either way, not
        counted)."""
        kept = {f"chunk_{name}" for name in (*CORE_ROWS, *CORE_PAIRS, "decay", "states")}
        kept.discard("chunk_gamma")  # allocated, never written or kept (CORE_ROWS)
        kept |= {f"scan_{name}_image" for name in SCAN_IMAGES}
        return sum(buffer.bytes for buffer in self.backward_buffers if buffer.name in kept)


def chain_kernel_us(longest_chunks: int, records: float) -> float:
    """One chain kernel (BUILD or EXPAND): its longest serial walk, or, when the walks are short
    and many, the time to stream `records` (chunk, head) records, whichever is longer."""
    return max(CHAIN_STEP_US * longest_chunks, RECORD_STREAM_US * records) + CHAIN_FIXED_US


def chain_cost(chunks: int, heads: int, segments: int) -> float:
    """Modelled microseconds of everything after PREP for `heads` heads of a `chunks`-chunk
    sequence cut into `segments`: unsplit, one EXPAND; split, BUILD over every segment but the
    last, COMBINE, then EXPAND, with two more gaps between kernels. Within 12% of every profiled
    count with at most one CTA an SM (see tests/test_plan.py). BUILD reads each record twice (its
    Mt and Ct walks), but the second read comes from L2: one streaming term fits both kernels."""
    records = chunks * heads
    if segments == 1:
        return chain_kernel_us(chunks, records)
    longest = math.ceil(chunks / segments)
    build = chain_kernel_us(longest, records * (segments - 1) / segments)
    combine = COMBINE_FIXED_US + COMBINE_STEP_US * (segments - 1)
    return build + combine + chain_kernel_us(longest, records) + 2 * LAUNCH_GAP_US


def segment_count(
    total_tokens: int, num_heads: int, num_sequences: int, sm_count: int | None
) -> int:
    """Segments per sequence: the count, up to what fills the SMs left idle by the N * H chains
    (one CTA an SM) and MAX_SEGMENTS, that chain_cost puts lowest for the average sequence
    (T / N tokens); the fewer segments on a tie. sm_count None (unknown device): no split."""
    if sm_count is None or num_sequences < 1 or num_heads < 1:
        return 1
    by_sms = sm_count // (CHAIN_CTAS * num_heads * num_sequences)
    chunks = math.ceil(total_tokens / num_sequences / CHUNK)
    heads = num_heads * num_sequences  # every sequence's chains stream records at once
    candidates = range(1, max(1, min(by_sms, MAX_SEGMENTS)) + 1)
    return min(candidates, key=lambda segments: (chain_cost(chunks, heads, segments), segments))


def plan_prefill(
    total_tokens: int,
    num_heads: int,
    num_sequences: int,
    sm_count: int | None = None,
    *,
    segments: int | None = None,
) -> PrefillPlan:
    """The sm90 plan for T tokens, H heads and N sequences on a device with sm_count SMs.

    PREP, parallel over (chunk slot, head), writes one record per slot (T // 16 + N slots, the
    gap-safe varlen mapping of xla.py); EXPAND, per (64-row slab, head, sequence, segment), runs
    the serial chain over those records with the state in registers. When the sequences are split
    into segments, BUILD first walks each segment but the last from the identity and from zero
    (the segment's operators Mt, Ct: St_end = St_start Mt + Ct) and COMBINE chains them into every
    segment's start state. The per-segment buffers exist only then; otherwise they are one
    minimal [1, 1, 1, 128, 128] slot that nothing reads.

    segments: force this many segments (tests, experiments; the kernels take any count, a segment
    past a sequence's end is empty); None: segment_count's choice for sm_count.
    """
    for name, value, low in (
        ("total_tokens", total_tokens, 0),
        ("num_heads", num_heads, 1),
        ("num_sequences", num_sequences, 1),
        ("segments", 1 if segments is None else segments, 1),
    ):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: got {value!r}, expected an int >= {low}")
    if segments is None:
        segments = segment_count(total_tokens, num_heads, num_sequences, sm_count)
    square = (HEAD_DIM, HEAD_DIM)
    if segments > 1:
        states = (segments, num_sequences, num_heads, *square)
        operators = (2 * (segments - 1), num_sequences, num_heads, *square)
    else:
        states = operators = (1, 1, 1, *square)
    records = (total_tokens // CHUNK + num_sequences, num_heads, CHUNK_RECORD_BYTES // 16, 4)
    slots = total_tokens // SCAN_CHUNK + num_sequences
    scan_states = (slots, num_heads, *square)
    chunk_rows = (slots, num_heads, SCAN_CHUNK, HEAD_DIM)
    chunk_pairs = (slots, num_heads, SCAN_CHUNK, SCAN_CHUNK)
    images = (slots, num_heads, SCAN_CHUNK * HEAD_DIM)
    return PrefillPlan(
        total_tokens=total_tokens,
        num_heads=num_heads,
        num_sequences=num_sequences,
        segment_count=segments,
        launches=4 if segments > 1 else 2,
        # EXPAND: z = N * segments + 1; BUILD: z = 2 N (segments - 1); state scan: z = N; y = H
        largest_grid_yz=max(
            num_heads, num_sequences * segments + 1, 2 * num_sequences * (segments - 1)
        ),
        workspace=(
            WorkspaceBuffer("chunk_records", records, "int32"),
            WorkspaceBuffer("segment_states", states, "float32"),
            WorkspaceBuffer("segment_operators", operators, "float32"),
        ),
        backward_buffers=(
            *(WorkspaceBuffer(f"chunk_{name}", chunk_rows, t) for name, t in CORE_ROWS.items()),
            *(WorkspaceBuffer(f"chunk_{name}", chunk_pairs, t) for name, t in CORE_PAIRS.items()),
            WorkspaceBuffer("chunk_decay", (slots, num_heads, HEAD_DIM), "float32"),
            *(WorkspaceBuffer(f"scan_{name}_image", images, "bfloat16") for name in SCAN_IMAGES),
            WorkspaceBuffer("scan_forward_addend_slices", chunk_rows, "float32"),
            WorkspaceBuffer(
                "scan_reverse_addend_slices", scan_states, "bfloat16" if BF16_ADDEND else "float32"
            ),
            WorkspaceBuffer("chunk_states", scan_states, "bfloat16" if BF16_STATES else "float32"),
            WorkspaceBuffer("chunk_state_cotangents", scan_states, "float32"),
        ),
    )


def scan_v_slice(
    num_heads: int, num_sequences: int, sm_count: int | None, both_directions: bool = False
) -> int:
    """Columns of the state per state-scan CTA: 32 when (128 / 32) CTAs per (sequence, head)
    already fill the SMs, else 16 (twice the CTAs, each re-reading the chunk's operands from L2;
    H200, tensor-core scan, both directions: 2048x12x1 95 us at 16 against 162 at 32).

    both_directions: for the backward's launch of both scans side by side (twice the CTAs),
    32 once its CTAs cover half the SMs: there the narrow slices' L2 re-reads, not idle SMs,
    bound the pair (H200, one launch: 2048x12x1, 96 CTAs at 32, 55.8 us against 59.5 at 16;
    8192x16x1 203.2 against 221.6; 1024x4x1, 32 CTAs at 32, 30.4 against 17.4)."""
    wide = max(SCAN_TC_V_SLICES)
    ctas = (HEAD_DIM // wide) * num_heads * num_sequences * (2 if both_directions else 1)
    enough = None if sm_count is None else (sm_count / 2 if both_directions else sm_count)
    if enough is None or ctas >= enough:
        return wide
    return min(SCAN_TC_V_SLICES)


def scan_outputs_v_slice(num_heads: int, num_sequences: int, sm_count: int | None) -> int | None:
    """The width at which the forward tensor-core scan writes the chunk outputs itself
    (backend.state_scan_outputs_kernel), or None where it should not: where each of its CTAs
    has an SM of its own, at the planned width (scan_v_slice) or else at the wide one (fewer
    CTAs, each twice the columns). The outputs' operands (Qg and Aqk, two stages, and images)
    take its shared memory from about 77 to 149 KiB (v_slice 16; 178 KiB with the outputs on
    a warpgroup of their own, two image pairs), one CTA an SM, so where the scan's CTAs
    outnumber the SMs the two kernels run one after the other instead. Unknown SM count: None."""
    if sm_count is None:
        return None
    planned = scan_v_slice(num_heads, num_sequences, sm_count)
    for v_slice in sorted({planned, max(SCAN_TC_V_SLICES)}):
        if (HEAD_DIM // v_slice) * num_heads * num_sequences <= sm_count:
            return v_slice
    return None
