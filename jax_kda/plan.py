"""Static planning of an sm90 prefill call: segments, launches and workspace, from shapes only.

Plain Python (no JAX, no CuTe), so it is unit-tested on any machine and the binding, the tests and
the benchmarks read one answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


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

    The current kernel is one fused launch: each (V-slab, head, sequence) CTA prepares its chunks
    and carries the state in registers, so it needs no workspace and never splits a sequence into
    segments (segment_count is 1 whatever the shapes).
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
        launches=1,
        workspace=(),
    )
