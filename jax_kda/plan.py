"""Static planning of an sm90 prefill call: segments, launches and workspace, from shapes only.

Plain Python (no JAX, no CuTe), so it is unit-tested on any machine and the binding, the tests and
the benchmarks read one answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from jax_kda.constants import CHUNK, HEAD_DIM

CHUNK_RECORD_BYTES = 21504
"""Bytes PREP writes per (chunk slot, head) for EXPAND: -wt, qg, kg^T (bf16 swizzled wgmma tiles,
4 KiB each), Z (bf16 16x16), a = exp(gamma) (f32 [128]) and ut^T (f32 [128, 16])."""

COMBINE_STEP_CHUNKS = 2
"""COMBINE's time per segment boundary in chain steps (one 16-token chunk of BUILD or EXPAND).
An estimate for the tensor-core COMBINE (24 m64n128k16 wgmma a step, its operator prefetched):
about 1.2 us against 0.65 us. Not yet measured; the float32 SIMT COMBINE it replaces measured
about 6.3 us (10 steps; benchmarks.kernel_profile on the H200)."""

SPLIT_OVERHEAD_CHUNKS = 6
"""The split's two extra launches, in chain steps (same measurements)."""

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
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


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

    @property
    def workspace_bytes(self) -> int:
        return sum(buffer.bytes for buffer in self.workspace)


def chain_cost(chunks: int, segments: int) -> float:
    """Modelled time of the serial part for a sequence of `chunks` chunks cut into `segments`, in
    chain steps: unsplit, one EXPAND step a chunk; split, BUILD then EXPAND over the longest
    segment, COMBINE's steps and the extra launches. At 1024x4x1, 2048x12x1 and 4096x12x1 it is
    within 10% of the profiled kernels (x 0.65 us)."""
    if segments == 1:
        return chunks
    longest = math.ceil(chunks / segments)
    return 2 * longest + COMBINE_STEP_CHUNKS * (segments - 1) + SPLIT_OVERHEAD_CHUNKS


def segment_count(
    total_tokens: int, num_heads: int, num_sequences: int, sm_count: int | None
) -> int:
    """Segments per sequence: the count, up to what fills the SMs left idle by the N * H chains
    and MAX_SEGMENTS, that chain_cost puts lowest for the average sequence (T / N tokens); the
    fewer segments on a tie. sm_count None (unknown device) means no split."""
    if sm_count is None or num_sequences < 1 or num_heads < 1:
        return 1
    by_sms = sm_count // (CHAIN_CTAS * num_heads * num_sequences)
    chunks = math.ceil(total_tokens / num_sequences / CHUNK)
    candidates = range(1, max(1, min(by_sms, MAX_SEGMENTS)) + 1)
    return min(candidates, key=lambda segments: (chain_cost(chunks, segments), segments))


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
    return PrefillPlan(
        total_tokens=total_tokens,
        num_heads=num_heads,
        num_sequences=num_sequences,
        segment_count=segments,
        launches=4 if segments > 1 else 2,
        workspace=(
            WorkspaceBuffer("chunk_records", records, "int32"),
            WorkspaceBuffer("segment_states", states, "float32"),
            WorkspaceBuffer("segment_operators", operators, "float32"),
        ),
    )
