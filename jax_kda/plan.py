"""Static planning of an sm90 prefill call: segments, launches and workspace, from shapes only.

Plain Python (no JAX, no CuTe), so it is unit-tested on any machine and the binding, the tests and
the benchmarks read one answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from jax_kda.constants import CHUNK

CHUNK_RECORD_BYTES = 21504
"""Bytes PREP writes per (chunk slot, head) for EXPAND: -wt, qg, kg^T (bf16 swizzled wgmma tiles,
4 KiB each), Z (bf16 16x16), a = exp(gamma) (f32 [128]) and ut^T (f32 [128, 16])."""


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


def plan_prefill(total_tokens: int, num_heads: int, num_sequences: int) -> PrefillPlan:
    """The sm90 plan for T tokens, H heads and N sequences.

    Two launches: PREP, parallel over (chunk slot, head), writes one record per slot into the
    workspace; EXPAND, per (V-slab, head, sequence), runs the serial chain over those records with
    the state in registers. There are T // 16 + N chunk slots (gap-safe varlen mapping, see
    xla.py). Sequences are not split into segments yet (segment_count is 1 whatever the shapes),
    so no per-segment buffer exists.
    """
    for name, value, low in (
        ("total_tokens", total_tokens, 0),
        ("num_heads", num_heads, 1),
        ("num_sequences", num_sequences, 1),
    ):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: got {value!r}, expected an int >= {low}")
    return PrefillPlan(
        total_tokens=total_tokens,
        num_heads=num_heads,
        num_sequences=num_sequences,
        segment_count=1,
        launches=2,
        workspace=(
            WorkspaceBuffer(
                "chunk_records",
                (total_tokens // CHUNK + num_sequences, num_heads, CHUNK_RECORD_BYTES // 16, 4),
                "int32",
            ),
        ),
    )
