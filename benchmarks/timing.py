"""What is measured per row, and how many calls each measurement takes."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """Call counts. The GPU-time loop runs about ``gpu_seconds`` of calls, at least
    ``min_loop_calls`` and at most ``max_loop_calls``; each timing is a median of ``repeats``."""

    warmup_calls: int
    per_call_samples: int
    pipelined_calls: int
    gpu_seconds: float
    min_loop_calls: int
    max_loop_calls: int
    repeats: int

    def loop_calls(self, seconds_per_call: float) -> int:
        wanted = math.ceil(self.gpu_seconds / max(seconds_per_call, 1e-7))
        return max(self.min_loop_calls, min(self.max_loop_calls, wanted))


FULL = Settings(
    warmup_calls=5,
    per_call_samples=50,
    pipelined_calls=50,
    gpu_seconds=0.1,
    min_loop_calls=20,
    max_loop_calls=1000,
    repeats=5,
)
QUICK = Settings(
    warmup_calls=1,
    per_call_samples=3,
    pipelined_calls=3,
    gpu_seconds=0.01,
    min_loop_calls=2,
    max_loop_calls=4,
    repeats=1,
)


@dataclass
class Timings:
    """One row's measurements (times in microseconds, the first call in milliseconds).

    gpu_us: device time per call, from many calls inside one jitted loop (JAX) or a replayed CUDA
      graph (torch); gpu_method says which, and why when it fell back.
    per_call_us: one call from Python, waited for, median of many.
    pipelined_us: many calls issued back to back, one wait at the end, divided by their count.
    first_call_ms: the first call in this process for this shape: compilation (or autotuning,
      graph building) plus one run.
    peak_bytes: device memory of one call, peak_method says how it was read (None: not readable).
    """

    gpu_us: float
    gpu_method: str
    gpu_calls: int
    per_call_us: float
    pipelined_us: float
    first_call_ms: float
    peak_bytes: int | None
    peak_method: str


def wall_seconds(fn: Callable[[], object]) -> float:
    """Host wall-clock seconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def host_seconds(
    one_call: Callable[[], object], pipelined: Callable[[], object], settings: Settings
) -> tuple[float, float]:
    """(per call, pipelined per call) in seconds: ``one_call`` waits for its result and is timed
    as a median after warm-up; ``pipelined`` issues ``settings.pipelined_calls`` chained calls and
    waits once."""
    for _ in range(settings.warmup_calls):
        one_call()
    per_call = statistics.median(wall_seconds(one_call) for _ in range(settings.per_call_samples))
    return per_call, wall_seconds(pipelined) / settings.pipelined_calls
