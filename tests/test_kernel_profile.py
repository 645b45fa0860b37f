"""benchmarks.kernel_profile: grouping profiler events into calls (no GPU needed)."""

import argparse

import jax
import jax.numpy as jnp
import pytest

from benchmarks.kernel_profile import CALL_GAP_NS, kernel_times, summarise


def _call(start, kernels):
    """Events of one call: back-to-back kernels (name, duration_ns) from start, 1 us apart."""
    events, t = [], start
    for name, duration in kernels:
        events.append((name, t, duration))
        t += duration + 1_000
    return events


def test_calls_split_at_idle_gaps_and_kernels_average_per_call():
    first = _call(0, [("prep", 10_000), ("chain", 20_000)])
    second = _call(10 * CALL_GAP_NS, [("prep", 12_000), ("chain", 30_000)])
    third = _call(20 * CALL_GAP_NS, [("prep", 14_000), ("chain", 40_000)])
    times = summarise(list(reversed(first + second + third)), 3)  # order must not matter
    assert times.launches == 2
    assert times.kernels_us == pytest.approx({"prep": 12.0, "chain": 30.0})
    assert times.span_us == pytest.approx(12.0 + 1.0 + 30.0)  # the median call


def test_repeated_kernel_names_within_a_call_add_up():
    events = _call(0, [("chain", 5_000), ("combine", 2_000), ("chain", 7_000)])
    times = summarise(events, 1)
    assert times.launches == 3
    assert times.kernels_us == pytest.approx({"chain": 12.0, "combine": 2.0})
    assert times.span_us == pytest.approx(16.0)


def test_overlapping_kernels_span_to_the_last_end():
    times = summarise([("a", 0, 50_000), ("b", 1_000, 2_000)], 1)
    assert times.span_us == pytest.approx(50.0)


def test_a_call_count_the_gaps_do_not_show_is_an_error():
    back_to_back = _call(0, [("prep", 10_000)]) + _call(12_000, [("prep", 10_000)])
    with pytest.raises(RuntimeError, match="found 1 calls in the trace, expected 2"):
        summarise(back_to_back, 2)
    with pytest.raises(RuntimeError, match="idled inside a call"):
        summarise(_call(0, [("a", 1_000)]) + _call(10 * CALL_GAP_NS, [("a", 1_000)]), 1)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the no-GPU error")
def test_no_gpu_events_is_an_error_that_says_so():
    with pytest.raises(RuntimeError, match="no GPU stream events"):
        kernel_times(jax.jit(lambda x: x * 2), jnp.ones(4), calls=1)


def test_train_variants_parse_into_training_forward_options():
    from benchmarks.kernel_profile import _variants

    off = {
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
    assert _variants("x1+s1+dense+ra")[0][1] == {
        **off, "dense_precision": "bf16", "scan_passes": 1, "dense_bwd": True, "fuse_addend": True,
    }  # fmt: skip
    assert _variants("x1+dense+bs")[0][1] == {
        **off, "dense_precision": "bf16", "dense_bwd": True, "both_scans": True,
    }  # fmt: skip
    assert _variants("base,core,v64,core+dbwd+v64+x3") == [
        ("base", off),
        ("core", {**off, "chunk_core": True}),
        ("v64", {**off, "scan_v_slice": 64, "scan_tensor_cores": False}),
        (
            "core+dbwd+v64+x3",
            {
                **off,
                "chunk_core": True,
                "decayed_bwd": True,
                "scan_v_slice": 64,
                "scan_tensor_cores": False,
                "dense_precision": "bf16x3",
            },
        ),
    ]
    assert _variants("core+dbwd+dense+tok")[0][1] == {
        **off, "chunk_core": True, "decayed_bwd": True, "dense_bwd": True, "tokens_bwd": True,
    }  # fmt: skip
    assert _variants("core+dbwd+dense+tok+sep")[0][1] == {
        **off, "chunk_core": True, "decayed_bwd": True, "dense_bwd": True, "tokens_bwd": True,
        "fuse_tokens": False,
    }  # fmt: skip
    assert _variants("x1+dense+fo")[0][1] == {
        **off, "dense_precision": "bf16", "dense_bwd": True, "fuse_outputs": True,
    }  # fmt: skip
    assert _variants("x1+dense+fo+fow")[0][1] == {
        **off, "dense_precision": "bf16", "dense_bwd": True, "fuse_outputs": True,
        "outputs_warpgroup": True,
    }  # fmt: skip
    assert _variants("x1+dense+fo+fow+oi")[0][1] == {
        **off, "dense_precision": "bf16", "dense_bwd": True, "fuse_outputs": True,
        "outputs_warpgroup": True, "outputs_images": True,
    }  # fmt: skip
    assert _variants("x1+dense+ua")[0][1] == {
        **off, "dense_precision": "bf16", "dense_bwd": True, "scan_plain_addend": True,
    }  # fmt: skip
    assert _variants("core+x1")[0][1] == {
        **off, "chunk_core": True, "dense_precision": "bf16",
    }  # fmt: skip
    assert _variants("core1")[0][1] == {**off, "chunk_core": True, "chunk_core_passes": 1}
    assert _variants("s1")[0][1] == {**off, "scan_passes": 1}
    assert _variants("x1+dense")[0][1] == {**off, "dense_precision": "bf16", "dense_bwd": True}
    with pytest.raises(argparse.ArgumentTypeError, match="unknown variant part 'v8'"):
        _variants("core+v8")


def test_timeline_spreads_a_chained_run_over_its_calls():
    """--chained's numbers: span, busy time (overlapping kernels counted once), the largest
    idle gap and per-kernel means, all per call."""
    from benchmarks.kernel_profile import timeline

    us = 1000
    events = [
        ("a", 0, 40 * us), ("b", 50 * us, 30 * us),  # call 1: a 10 us gap
        ("a", 80 * us, 40 * us), ("b", 100 * us, 40 * us),  # call 2: b overlaps a
    ]  # fmt: skip
    found = timeline(events, 2)
    assert found.span_us == 70.0 and found.busy_us == 65.0 and found.largest_gap_us == 10.0
    assert found.kernels_us == {"a": 40.0, "b": 35.0}


def test_chunk_core_phase_table_reads_the_stamps():
    """benchmarks.chunk_core_phases: per-phase cycles from the raw cycle counters (one that
    wraps within a CTA included), CTA durations and the span from the global timer's low 32
    bits (a start just before the wrap and an end after it included), the mean concurrency."""
    import numpy as np

    from benchmarks.chunk_core_phases import format_table, phase_table

    wrap = 2**32
    near = wrap - 500  # a CTA that starts 500 ns before the low bits wrap

    def as_int32(values):
        return np.asarray(values, np.int64).astype(np.uint32).view(np.int32)

    clock = wrap - 1500  # a cycle counter that wraps within the first CTA
    stamps = as_int32(
        [
            [clock, clock + 1000, clock + 3000, near, near + 2000],  # 2000 ns, after the wrap
            [7, 2007, 3007, near + 1000, near + 3000],
            [0, 1000, 5000, near + 500, near + 4500],  # 4000 ns
        ]
    ).reshape(3, 1, 5)
    table = phase_table(stamps, ("first", "second"))
    assert table.ctas == 3
    assert table.phases["first"] == (1000.0, np.percentile([1000, 2000, 1000], 90))
    assert table.phases["second"][0] == 2000.0  # steps 2000, 1000, 4000
    assert table.cta_us[1] == 2.0
    assert abs(table.span_us - 4.5) < 1e-9  # the first start to the last end, near + 4500
    assert abs(table.concurrent - 8000 / 4500) < 1e-9
    assert abs(table.cycles_per_ns - 3000 / 2000) < 1e-9
    text = format_table("1x1x1", table)
    assert "| first | 1000 | 33% |" in text and "3 CTAs" in text
    with pytest.raises(ValueError, match="got 5 a CTA, expected 6 for 3 phases"):
        phase_table(stamps, ("first", "second", "third"))
    with pytest.raises(ValueError, match="no CTAs"):
        phase_table(np.zeros((0, 2, 5), np.int32), ("first", "second"))


def test_phase_table_counts_the_ctas_in_each_phase_at_once():
    """benchmarks.chunk_core_phases.phase_table's at_once: CTAs in step (two loading together,
    then computing together) against one out of step, each at its own clock rate."""
    import numpy as np

    from benchmarks.chunk_core_phases import BINS, phase_table

    # per CTA: cycles at start and after each phase, then the global timer (ns) at start and end
    stamps = np.asarray(
        [
            [0, 1000, 3000, 0, 3000],  # 1 cycle/ns: "load" [0, 1000), "compute" [1000, 3000)
            [0, 2000, 6000, 0, 3000],  # 2 cycles/ns: the same times
            [0, 1000, 3000, 3000, 6000],  # out of step: "load" [3000, 4000)
        ],
        np.int32,
    ).reshape(3, 1, 5)
    table = phase_table(stamps, ("load", "compute"))
    mean, p90 = table.at_once["load"]
    # over the 6000 ns span: two CTAs for 1000 ns, one for 1000 ns, none for 4000 ns
    assert abs(mean - 3000 / 6000) < 2 * 3 / BINS
    assert p90 == 2.0  # two at once for the last sixth of the sorted samples: bursty
    compute_mean, compute_p90 = table.at_once["compute"]
    # [1000, 3000) two at once, [4000, 6000) one: two thirds of the span, 6000 CTA-ns
    assert abs(compute_mean - 6000 / 6000) < 2 * 3 / BINS and compute_p90 == 2.0
