"""``python -m benchmarks.chunk_core_phases [--only TERMS] [--residuals]``: where a chunk-core
CTA's time goes, phase by phase, read from the CTAs' own clocks (a GPU-machine diagnostic).

The chunk core (kernels/kda_chunk_operands_sm90.py) runs one CTA a (64-token chunk, head), its
phases one after another between barriers; Nsight Compute finds its stalls "spread over every
phase, no hot spot" (results/2026-12-03-h200-ncu-step.md), and the profiler sees only the
kernel's span. Its stamps variant (sm90.backend.chunk_core_stamps) has thread 0 of every CTA
read the SM's cycle counter at each phase's end and the global timer at the CTA's start and end;
this prints, per shape, the median cycles of each phase and its share of a CTA, the CTAs'
durations, how many ran at once on average, the kernel's span, and per phase how many CTAs
were in it at once (mean and 90th percentile over the span). The forward-alone variant
(the no-bound forward's) by default; --residuals: the training variant.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PhaseTable:
    ctas: int
    span_us: float
    """First CTA start to last CTA end (the global timer)."""
    cta_us: tuple[float, float, float]
    """CTA durations: 10th percentile, median, 90th percentile."""
    concurrent: float
    """Mean CTAs running at once: their summed durations over the span."""
    cycles_per_ns: float
    """Median cycles of a CTA over its median duration: the SM clock the CTAs ran at."""
    phases: dict[str, tuple[float, float]]
    """Per phase: median cycles and 90th-percentile cycles."""
    at_once: dict[str, tuple[float, float]]
    """Per phase: how many CTAs were in it at once over the span, sampled at BINS points: the
    mean and the 90th percentile. CTAs whose load phases run in step (all loading together,
    then all computing) show a 90th percentile far above the mean; spread out, near it."""


BINS = 2000
"""Sampling points over a kernel's span for PhaseTable.at_once."""


def phase_table(stamps: np.ndarray, phases) -> PhaseTable:
    """stamps: int32 [..., 1 + len(phases) + 2] as the stamps variant writes them: thread 0's
    32-bit cycle counter at the CTA's start and at each phase's end (raw: wrapping modulo 2^32),
    then the global timer's low 32 bits (ns) at the CTA's start and at its end."""
    count = len(phases)
    stamps = np.asarray(stamps)
    if stamps.shape[-1] != count + 3:
        raise ValueError(
            f"stamps: got {stamps.shape[-1]} a CTA, expected {count + 3} for {count} phases"
        )
    flat = stamps.reshape(-1, count + 3).astype(np.int64)
    if flat.shape[0] == 0:
        raise ValueError("no CTAs: the call had no chunk slots")
    clocks = (flat[:, : count + 1] - flat[:, :1]) % 2**32  # cycles since the start
    steps = np.diff(clocks, axis=1)
    timer = flat[:, count + 1 :].astype(np.uint32)
    # the low 32 bits wrap every 4.3 s: offsets from the first CTA's start, signed, modulo 2^32
    starts = (timer[:, 0].astype(np.int64) - int(timer[0, 0]) + 2**31) % 2**32 - 2**31
    starts -= starts.min()
    durations = (timer[:, 1] - timer[:, 0]).astype(np.int64)  # modulo 2^32, as uint32
    ends = starts + durations
    span = float(ends.max() - starts.min())
    total = clocks[:, -1]
    # each CTA's phases on the global timer, at its own clock rate (cycles over nanoseconds)
    rate = total / np.maximum(durations, 1)
    edges = starts[:, None] + clocks / np.maximum(rate, 1e-9)[:, None]
    times = starts.min() + (np.arange(BINS) + 0.5) * span / BINS
    at_once = {}
    for i, name in enumerate(phases):
        inside = (edges[:, i, None] <= times) & (times < edges[:, i + 1, None])
        counts = inside.sum(axis=0)
        at_once[name] = (float(counts.mean()), float(np.percentile(counts, 90)))
    return PhaseTable(
        ctas=flat.shape[0],
        span_us=span / 1e3,
        cta_us=tuple(float(np.percentile(durations, p)) / 1e3 for p in (10, 50, 90)),
        concurrent=float(durations.sum()) / span if span > 0 else float("nan"),
        cycles_per_ns=float(np.median(total)) / max(float(np.median(durations)), 1.0),
        phases={
            name: (float(np.median(steps[:, i])), float(np.percentile(steps[:, i], 90)))
            for i, name in enumerate(phases)
        },
        at_once=at_once,
    )


def format_table(name: str, table: PhaseTable) -> str:
    total = sum(median for median, _ in table.phases.values())
    lines = [
        f"{name}: {table.ctas} CTAs, span {table.span_us:.1f} us, a CTA {table.cta_us[1]:.2f} us"
        f" (p10 {table.cta_us[0]:.2f}, p90 {table.cta_us[2]:.2f}), {table.concurrent:.0f} at "
        f"once on average, {table.cycles_per_ns:.2f} cycles/ns",
        "| phase | median cycles | share | p90 cycles | CTAs in it at once: mean, p90 |",
        "|---|---|---|---|---|",
    ]
    for phase, (median, p90) in table.phases.items():
        share = median / total if total else float("nan")
        mean, high = table.at_once[phase]
        lines.append(
            f"| {phase} | {median:.0f} | {share:.0%} | {p90:.0f} | {mean:.1f}, {high:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="2048x12x1,8192x16x1,33x2x3-ragged")
    parser.add_argument("--residuals", action="store_true", help="the training variant")
    options = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from benchmarks.selection import parse_only, select
    from benchmarks.shapes import ALL_SHAPES
    from jax_kda import sm90, xla
    from jax_kda.constants import default_scale
    from jax_kda.oracle import production_inputs
    from jax_kda.sm90.ffi_call import register
    from jax_kda.sm90.kernels.kda_chunk_operands_sm90 import PHASES

    register()
    shapes, _ = select(parse_only(options.only), ALL_SHAPES, [])
    run = jax.jit(sm90.backend.chunk_core_stamps, static_argnums=(6, 7, 8, 9))
    for shape in shapes:
        x = production_inputs(list(shape.lengths), shape.heads, seed=0)
        args = [jnp.asarray(a) for a in x[:6]]
        slots = xla.chunk_slot_count(x.q.shape[0], len(shape.lengths))
        call = (*args, slots, default_scale(), 1, options.residuals)
        jax.block_until_ready(run(*call))  # compile, and a first run
        stamps = np.asarray(run(*call))
        print(format_table(shape.name, phase_table(stamps, PHASES)), flush=True)


if __name__ == "__main__":
    main()
