"""GPU kernel times of one jitted call, read from JAX's profiler (CUPTI), not from wall clocks.

``kernel_times(fn, *args)`` runs ``fn`` a few times under ``jax.profiler.trace`` and returns, per
kernel name, the mean duration per call, plus the median span per call (first kernel start to
last kernel end on the device). The span is what the GPU spends on one call when nothing else queues
behind it; the sum of the kernel durations is the busy time within it.

``python -m benchmarks.kernel_profile [--only TERMS] [--segments 1,2,4] [--train]`` prints that
breakdown for jax_kda's sm90 backend on the harness's shapes, as planned for this device or cut
into each given segment count, or (--train) for a training step: forward and backward (a
diagnostic for kernel work and for plan.py's cost model; the results tables come from
``benchmarks.run``). ``--train-variants base,core+dbwd+x3,core+dbwd+x3+v64`` profiles the
backward's recompute and backward with the named kernels switched in and the rest off (with
``--forward-only``, their forward alone: the no-bound forward);
core1+dbwd+x1+s1+dense+tok+bs+fo+fow+ua is the default.
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import statistics
import tempfile
from dataclasses import dataclass

import jax

from jax_kda.sm90.kernels.layout import SCAN_VARIANTS


@dataclass(frozen=True)
class KernelTimes:
    span_us: float
    """Median over calls of (last kernel end - first kernel start)."""
    kernels_us: dict[str, float]
    """Mean duration per call of each kernel name (summed over its launches in one call)."""
    launches: int
    """Kernel launches per call."""


def _gpu_events(path: str):
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            # Stream lines hold the kernels; skip the per-plane summary lines XLA adds.
            if not line.name.startswith("Stream"):
                continue
            for event in line.events:
                yield event.name, event.start_ns, event.duration_ns


def kernel_times(fn, *args, calls: int = 5) -> KernelTimes:
    """Profile ``calls`` separate, synchronised calls of ``fn(*args)`` (compiled first)."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory(prefix="kda-profile-") as directory:
        with jax.profiler.trace(directory):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        paths = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)
        if not paths:
            raise RuntimeError(f"the profiler wrote no trace under {directory}")
        events = list(_gpu_events(paths[0]))
        if not events:
            from jax.profiler import ProfileData

            planes = ProfileData.from_file(paths[0]).planes
            lines = [f"{p.name}: {[line.name for line in p.lines]}" for p in planes]
            raise RuntimeError(f"the trace has no GPU stream events (no GPU or no CUPTI?): {lines}")
    return summarise(events, calls)


@dataclass(frozen=True)
class ChainedTimes:
    calls: int
    span_us: float
    """Device time from the first kernel's start to the last one's end, per call."""
    busy_us: float
    """Time some kernel ran (the union of their intervals), per call."""
    largest_gap_us: float
    """The longest idle stretch between two kernels."""
    kernels_us: dict[str, float]
    """Mean duration per call of each kernel name."""


def chained_times(run, copies, state, executions: int) -> ChainedTimes:
    """Profile the harness's GPU-time measurement (benchmarks.jax_measure: ``executions`` runs
    of ``run``, one executable of ``len(copies)`` chained calls, each on its own copy of the
    inputs) and spread its device timeline over the calls: where the harness's time per call
    exceeds a call's span in isolation, this tells idle device time between the kernels
    (launches not kept ahead) from kernels that themselves run slower when chained."""
    from benchmarks.jax_measure import back_to_back

    back_to_back(run, copies, state, executions)
    with tempfile.TemporaryDirectory(prefix="kda-profile-") as directory:
        with jax.profiler.trace(directory):
            back_to_back(run, copies, state, executions)
        paths = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)
        if not paths:
            raise RuntimeError(f"the profiler wrote no trace under {directory}")
        events = list(_gpu_events(paths[0]))
    if not events:
        raise RuntimeError("the trace has no GPU stream events (no GPU or no CUPTI?)")
    return timeline(events, executions * len(copies))


def timeline(events, calls: int) -> ChainedTimes:
    """``events``: ``(name, start_ns, duration_ns)`` of every kernel of ``calls`` chained calls,
    spread over the calls (chained_times' numbers)."""
    events = sorted(events, key=lambda e: e[1])
    busy, gap, end = 0, 0, None
    totals = collections.defaultdict(float)
    for name, start, duration in events:
        totals[name] += duration / 1e3
        if end is None or start >= end:
            busy += duration
            if end is not None:
                gap = max(gap, start - end)
            end = start + duration
        elif start + duration > end:
            busy += start + duration - end
            end = start + duration
    span = end - events[0][1]
    return ChainedTimes(
        calls=calls,
        span_us=span / 1e3 / calls,
        busy_us=busy / 1e3 / calls,
        largest_gap_us=gap / 1e3,
        kernels_us={name: total / calls for name, total in totals.items()},
    )


def _profile_chained(shapes, calls: int, exact: bool):
    """--chained: prefill's forward as the harness times it (executables of 10 chained calls,
    each on its own copy of the inputs) against the same call profiled alone."""
    import jax.numpy as jnp

    import jax_kda
    from benchmarks.jax_measure import chained_calls, distinct_copies
    from jax_kda.oracle import production_inputs
    from jax_kda.sm90.ffi_call import register

    register()
    bound = None if exact else -5.0
    per_execution = 10
    executions = max(1, calls // per_execution)
    for shape in shapes:
        x = [jnp.asarray(a) for a in production_inputs(list(shape.lengths), shape.heads, seed=0)]
        args, state = tuple(x[:6]), x[6]

        def step(args, state):
            q, k, v, g, beta, cu = args
            o, final = jax_kda.prefill(
                q, k, v, g, beta, cu_seqlens=cu, initial_state=state, gate_lower_bound=bound,
                backend="sm90",
            )  # fmt: skip
            return final, o

        single = jax.jit(step)
        alone = kernel_times(single, args, state)
        copies = distinct_copies(args, per_execution)
        chained = chained_times(chained_calls(step), copies, state, executions)
        print(
            f"{shape.name} {'exact' if exact else 'bounded'}: alone span {alone.span_us:.1f} "
            f"us; chained ({chained.calls} calls) span {chained.span_us:.1f} us a call, kernels "
            f"busy {chained.busy_us:.1f}, largest idle gap {chained.largest_gap_us:.1f} us"
        )
        for kernel, us in sorted(chained.kernels_us.items(), key=lambda kv: -kv[1]):
            was = alone.kernels_us.get(kernel)
            print(f"    {us:9.1f} us  ({'-' if was is None else f'{was:.1f}'} alone)  "
                  f"{_short_name(kernel)}")  # fmt: skip


CALL_GAP_NS = 50_000
"""Idle device time that separates one synchronised call from the next."""


def summarise(events, calls: int) -> KernelTimes:
    """``events``: ``(name, start_ns, duration_ns)`` of the kernels of ``calls`` calls run one at
    a time. Calls are told apart by idle device time between them; when that does not find
    ``calls`` of them (a call with a long idle gap inside, or calls run back to back), this is
    an error rather than a wrong average."""
    groups, current, last_end = [], [], None
    for name, start, duration in sorted(events, key=lambda e: e[1]):
        if current and start - last_end > CALL_GAP_NS:
            groups.append(current)
            current = []
        current.append((name, start, duration))
        last_end = start + duration if last_end is None else max(last_end, start + duration)
    groups.append(current)
    if len(groups) != calls:
        raise RuntimeError(
            f"found {len(groups)} calls in the trace, expected {calls}: the device idled "
            f"{'inside a call' if len(groups) > calls else 'too little between calls'}"
        )
    spans = [(max(s + d for _, s, d in g) - g[0][1]) / 1e3 for g in groups]
    totals = collections.defaultdict(float)
    for group in groups:
        for name, _, duration in group:
            totals[name] += duration / 1e3
    return KernelTimes(
        span_us=statistics.median(spans),
        kernels_us={name: total / len(groups) for name, total in totals.items()},
        launches=round(sum(len(g) for g in groups) / len(groups)),
    )


def _main():
    import jax.numpy as jnp

    import jax_kda
    from benchmarks.selection import parse_only, select
    from benchmarks.shapes import ALL_SHAPES
    from jax_kda import sm90
    from jax_kda.constants import default_scale
    from jax_kda.oracle import production_inputs
    from jax_kda.sm90.ffi_call import register
    from jax_kda.sm90.plan import plan_prefill

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        default="2048x12x1,1024x4x1,4096x12x1,33x2x3-ragged,8192x64x1",
        help="shapes or shape groups, as benchmarks.run's --only",
    )
    parser.add_argument(
        "--segments",
        type=_segment_counts,
        default=None,
        help="comma-separated segment counts to cut every sequence into (e.g. 1,2,4,8); "
        "default: the plan for this device",
    )
    parser.add_argument(
        "--train",
        action="store_true",
        help="profile a training step (jax.vjp of o and the final state, all six gradients)",
    )
    parser.add_argument(
        "--train-variants",
        type=_variants,
        default=None,
        help="instead, profile the sm90 backward's recompute and backward (jax.vjp of "
        "sm90.training_forward) for each variant: comma-separated 'base' (none of these), 'core' "
        "(the chunk-core kernel's operands), 'dbwd' (with core: their backward's decayed "
        "products on their kernel), 'x3' (the dense products around the scan as bf16x3), "
        "'v16'/'v32'/'v64' (the float32 state-scan variants) or 't16'/'t32' (the tensor-core "
        "scan with the V-slice as wgmma N), 'dense' (the scan and the outputs around it as one "
        "VJP, its backward's products on their kernel), 'tok' (with dense: the element-wise rest "
        "on its kernel, into the tokens' rows, fused into the decayed kernel where both are "
        "on), 'sep' (with tok: the decayed and tokens kernels one after the other), 'fo' (with "
        "dense: the forward scan writes the outputs where the plan fuses them), 'fow' (with fo: "
        "its O products and stores on a second warpgroup), 'oi' (with fow: Qg and Aqk from "
        "the chunk core as that warpgroup's images), 'ua' (with "
        "dense: the forward scan reads the chunk core's bf16 U as it is), 'bs' "
        "(with dense: both state scans in the "
        "backward, in one launch), 'ra' (with x1+s1+dense, without bs: the reverse scan forms "
        "its addend on a warpgroup of its own), joined by '+' (e.g. base,core+dbwd+v64+x3)",
    )
    parser.add_argument(
        "--forward-only",
        action="store_true",
        help="with --train-variants: profile the variants' forward alone",
    )
    parser.add_argument(
        "--chained",
        type=int,
        default=None,
        metavar="CALLS",
        help="instead, profile prefill's forward in the harness's chained loop of CALLS calls "
        "(10 an iteration) beside the call alone: span, busy time and idle gaps per call",
    )
    parser.add_argument(
        "--exact",
        action="store_true",
        help="with --chained: no gate bound (the exact forward); default: gate_lower_bound=-5",
    )
    options = parser.parse_args()
    if options.exact and options.chained is None:
        parser.error("--exact goes with --chained")
    if options.forward_only and not options.train_variants:
        parser.error("--forward-only goes with --train-variants")
    if options.train and options.segments:
        parser.error("--train profiles the planned call; forced --segments have no backward")
    shapes, _ = select(parse_only(options.only), ALL_SHAPES, [])
    if options.chained is not None:
        _profile_chained(shapes, options.chained, options.exact)
        return
    if options.train_variants:
        _profile_variants(options.train_variants, shapes, options.forward_only)
        return
    register()  # sm90.forward is called directly below, not through prefill

    def call_for(segments):
        @jax.jit
        def call(q, k, v, g, beta, cu, state):
            if segments is None:
                return jax_kda.prefill(
                    q, k, v, g, beta, cu_seqlens=cu, initial_state=state,
                    output_final_state=True, gate_lower_bound=-5.0, backend="sm90",
                )  # fmt: skip
            scale = default_scale()
            return sm90.forward(q, k, v, g, beta, cu, state, scale, segments=segments)

        if not options.train:
            return call

        @jax.jit
        def step(q, k, v, g, beta, cu, state, d_o, d_final):
            out, pullback = jax.vjp(lambda *a: call(*a[:5], cu, a[5]), q, k, v, g, beta, state)
            return out, pullback((d_o, d_final))

        return step

    for shape in shapes:
        x = [jnp.asarray(a) for a in production_inputs(list(shape.lengths), shape.heads, seed=0)]
        if options.train:
            x += [jnp.ones_like(x[0]), jnp.ones_like(x[-1])]
        for segments in options.segments or [None]:
            times = kernel_times(call_for(segments), *x)
            planned = plan_prefill(
                shape.total_tokens, shape.heads, shape.num_sequences, sm90.device_sm_count(),
                segments=segments,
            ).segment_count  # fmt: skip
            print(
                f"{shape.name}: {planned} segment(s){'' if segments else ' (planned)'}, "
                f"span {times.span_us:.1f} us, {times.launches} launches"
            )
            for kernel, us in sorted(times.kernels_us.items(), key=lambda kv: -kv[1]):
                print(f"    {us:9.1f} us  {_short_name(kernel)}")


def _variants(text: str) -> list[tuple[str, dict]]:
    """'base,core+v64' -> [('base', {all off}), ('core+v64', {'chunk_core': True, ...})]: every
    variant names the kernels it switches on and states the rest off ('base' is the XLA path's
    per-chunk parts at HIGHEST around the SIMT scan; the kernels at three bf16 passes a product
    unless a part ends in 1), whatever training_forward's defaults."""
    out = []
    for name in text.split(","):
        options = {
            "chunk_core": False,
            "decayed_bwd": False,
            "dense_precision": "float32",
            "chunk_core_passes": 3,
            "scan_passes": 3,
            "dense_bwd": False,
            "tokens_bwd": False,
            "both_scans": False,
            "fuse_outputs": False,
            "scan_plain_addend": False,
            "outputs_warpgroup": False,
            "outputs_images": False,
            "fuse_addend": False,
        }
        for part in name.split("+"):
            if part == "core":
                options["chunk_core"] = True
            elif part == "core1":  # the chunk core with one bf16 pass a product
                options["chunk_core"] = True
                options["chunk_core_passes"] = 1
            elif part == "dbwd":
                options["decayed_bwd"] = True
            elif part == "x3":
                options["dense_precision"] = "bf16x3"
            elif part == "s1":  # the tensor-core state scan with one bf16 pass a product
                options["scan_passes"] = 1
            elif part == "x1":  # the dense products as one bf16 pass
                options["dense_precision"] = "bf16"
            elif part == "dense":  # the scan and outputs as one VJP, their backward's kernel
                options["dense_bwd"] = True
            elif part == "tok":  # with dense: the element-wise rest on its kernel, to tokens
                options["tokens_bwd"] = True
            elif part == "sep":  # with tok: the decayed and tokens kernels one after the other
                options["fuse_tokens"] = False
            elif part == "fo":  # with dense: the forward scan writes the outputs (as planned)
                options["fuse_outputs"] = True
            elif part == "fow":  # with fo: its O products on a second warpgroup
                options["outputs_warpgroup"] = True
            elif part == "oi":  # with fow: Qg and Aqk from the chunk core as images
                options["outputs_images"] = True
            elif part == "ua":  # with dense: the forward scan reads U bf16, plain
                options["scan_plain_addend"] = True
            elif part == "bs":  # with dense: both state scans in the backward, one launch
                options["both_scans"] = True
            elif part == "ra":  # with dense: the reverse scan forms its addend itself
                options["fuse_addend"] = True
            elif part in SCAN_VARIANTS:
                options["scan_v_slice"], options["scan_tensor_cores"] = SCAN_VARIANTS[part]
            elif part != "base":
                raise argparse.ArgumentTypeError(f"unknown variant part {part!r} in {name!r}")
        out.append((name, options))
    return out


def _profile_variants(variants, shapes, forward_only=False):
    """GPU kernel times of jax.vjp of sm90.training_forward (what the sm90 backward runs) per
    variant, or (forward_only) of the forward alone (what a call without a gate bound runs), on
    the harness's production data with a non-zero initial state."""
    import jax.numpy as jnp

    from jax_kda import sm90
    from jax_kda.constants import default_scale
    from jax_kda.oracle import production_inputs
    from jax_kda.sm90.ffi_call import register

    register()
    for shape in shapes:
        x = [jnp.asarray(a) for a in production_inputs(list(shape.lengths), shape.heads, seed=0)]
        x += [jnp.ones_like(x[0]), jnp.ones_like(x[-1])]  # the cotangents of o and the state
        for name, options in variants:

            @jax.jit
            def step(q, k, v, g, beta, cu, state, d_o, d_final, options=options):
                def forward(q, k, v, g, beta, state):
                    return sm90.training_forward(
                        q, k, v, g, beta, cu, state, default_scale(), **options
                    )

                if forward_only:
                    return forward(q, k, v, g, beta, state)
                # the gradients alone, as in a training step whose outputs come from the
                # forward kernels: the recompute's own outputs are dead code there
                _, pullback = jax.vjp(forward, q, k, v, g, beta, state)
                return pullback((d_o, d_final))

            times = kernel_times(step, *x)
            what = "forward" if forward_only else "recompute + backward"
            busy = sum(times.kernels_us.values())
            print(
                f"{shape.name} {name} ({what}): span {times.span_us:.1f} us, "
                f"{times.launches} launches, kernels busy {busy:.1f} us"
            )
            for kernel, us in sorted(times.kernels_us.items(), key=lambda kv: -kv[1]):
                print(f"    {us:9.1f} us  {_short_name(kernel)}")


def _segment_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2,4; got {text!r}")
    return counts


def _short_name(kernel: str) -> str:
    """CuTe DSL's mangled kernel name cut to the kernel module it came from (the sm90 package's
    kernels/*.py), or else to its method (prep_kernel, ...), and the tail that tells its
    specialisations apart (BUILD and EXPAND are one method; a scan's directions one module)."""
    module = re.search(r"sm90kernels([a-z0-9_]+?)[A-Z]\w*?_object_at_", kernel)
    if kernel.startswith("kernel_cutlass_") and module:
        return f"{module.group(1)} ...{kernel[-24:]}"
    marker = kernel.find("_kernel_")
    if kernel.startswith("kernel_cutlass_") and marker > 0:
        return f"{kernel[len('kernel_cutlass_') : marker + len('_kernel')]} ...{kernel[-24:]}"
    return kernel[:110]


if __name__ == "__main__":
    _main()
