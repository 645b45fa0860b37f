"""CPU tests of the benchmark harness's pure parts: the HBM floor, the shape registry, --only,
the results bookkeeping and the report built from a small made-up results JSON."""

import math

import pytest

from benchmarks import results
from benchmarks.adapters import IMPLEMENTATION_NAMES
from benchmarks.hbm import hbm_floor_bytes, hbm_floor_us
from benchmarks.report import markdown_summary, write_report
from benchmarks.selection import parse_only, select
from benchmarks.shapes import ALL_SHAPES, QUICK_SHAPE_NAMES, SPEC_SHAPES, shape_by_name


def test_hbm_floor_counts_each_tensor_once():
    # T=2, H=1, N=1: q, k, v 3*2*128*2, g 2*128*4, beta 2*4, o 2*128*2, states 2*128*128*4
    assert hbm_floor_bytes(2, 1, 1) == 1536 + 1024 + 8 + 512 + 131072


@pytest.mark.parametrize(
    ("name", "floor_us"),
    [("2048x12x1", 8.2), ("8192x12x4", 32.8), ("1024x4x1", 1.4), ("16384x16x8", 87.6)],
)
def test_hbm_floor_matches_spec_table(name, floor_us):
    shape = shape_by_name(name)
    floor = hbm_floor_us(shape.total_tokens, shape.heads, shape.num_sequences)
    assert round(floor, 1) == floor_us


def test_shape_registry():
    assert len(SPEC_SHAPES) == 10
    names = [s.name for s in ALL_SHAPES]
    assert len(set(names)) == len(names)
    assert shape_by_name("8192x12x4").lengths == (2048,) * 4
    assert shape_by_name("33x2x3-ragged").lengths == (17, 0, 16)
    assert shape_by_name("8192x64x6-ragged").lengths == (1300, 547, 2048, 963, 271, 3063)
    assert shape_by_name("8192x32x64").lengths == (128,) * 64
    assert {s.heads for s in ALL_SHAPES if s.group == "flashkda"} == {64, 96}
    for name in QUICK_SHAPE_NAMES:
        shape_by_name(name)
    with pytest.raises(KeyError):
        shape_by_name("1x1x1")


def test_only_filters_shapes_and_implementations_independently():
    shapes, impls = select(parse_only("xla"), ALL_SHAPES, IMPLEMENTATION_NAMES)
    assert impls == ["jax_kda/xla"] and len(shapes) == len(ALL_SHAPES)
    shapes, impls = select(parse_only("2048x12x1, cudnn spec"), ALL_SHAPES, IMPLEMENTATION_NAMES)
    assert impls == ["cudnn/kda_hopper", "cudnn/kda_hopper_cuda"]
    assert shapes == list(SPEC_SHAPES)
    shapes, impls = select(parse_only("kda_hopper,8192x96x1"), ALL_SHAPES, IMPLEMENTATION_NAMES)
    assert impls == ["cudnn/kda_hopper"] and [s.name for s in shapes] == ["8192x96x1"]
    assert select([], ALL_SHAPES, IMPLEMENTATION_NAMES) == (
        list(ALL_SHAPES),
        list(IMPLEMENTATION_NAMES),
    )
    with pytest.raises(ValueError, match="nonsense"):
        select(["nonsense"], ALL_SHAPES, IMPLEMENTATION_NAMES)


def _row(shape, impl, gpu_us=None, reason=None):
    s = shape_by_name(shape)
    row = {
        "shape": shape,
        "implementation": impl,
        "hbm_floor_us": hbm_floor_us(s.total_tokens, s.heads, s.num_sequences),
    }
    if gpu_us is None:
        return {**row, "status": "unavailable", "reason": reason, "notes": "n"}
    return {
        **row,
        "status": "ok",
        "gpu_us": gpu_us,
        "gpu_method": "loop",
        "per_call_us": gpu_us + 10,
        "pipelined_us": gpu_us + 1,
        "first_call_ms": 100.0,
        "peak_bytes": 2**20,
        "peak_method": "analysis",
        "rms_ratio": {"o": 5e-3, "final_state": 4e-3},
        "accuracy_sample": "sequence 0 (tokens 0:2048, all of it), heads [0, 11]",
        "notes": "call",
    }


@pytest.fixture
def document():
    spec = [s.name for s in SPEC_SHAPES]
    rows = [_row(name, "jax_kda/xla", 100.0 * (i + 1)) for i, name in enumerate(spec)]
    rows += [_row(name, "fla/chunk_kda", 200.0 * (i + 1)) for i, name in enumerate(spec[:5])]
    rows += [_row("33x2x3-ragged", "jla/mosaic_gpu", reason="ragged: segment_ids only")]
    return {"mode": "forward", "device": "Test GPU", "date": "2026-11-30", "seed": 7,
            "settings": {}, "environment": {"jax": "0"}, "rows": rows}  # fmt: skip


def test_geomeans_and_ratios(document):
    value, covered = results.spec_geomean(document, "jax_kda/xla")
    assert covered == 10
    assert value == pytest.approx(100.0 * math.factorial(10) ** 0.1)
    ratio, shared = results.spec_ratio(document, "fla/chunk_kda", "jax_kda/xla")
    assert (ratio, shared) == (pytest.approx(2.0), 5)


def test_resume_skips_only_finished_rows(document):
    done = results.finished(document)
    assert ("2048x12x1", "jax_kda/xla") in done
    assert ("33x2x3-ragged", "jla/mosaic_gpu") not in done
    results.upsert(document, _row("2048x12x1", "jax_kda/xla", 1.0))
    assert len(document["rows"]) == 16
    assert results.gpu_times(document, "jax_kda/xla")["2048x12x1"] == 1.0


def test_device_slug_and_default_path():
    assert results.device_slug("NVIDIA H200") == "h200"
    assert results.default_path("2026-11-30", "NVIDIA H200", "forward").name == (
        "2026-11-30-h200.json"
    )
    assert results.default_path("2026-11-30", "cpu", "train").name == "2026-11-30-cpu-train.json"


def test_report_from_json(document, tmp_path):
    summary = markdown_summary(document)
    assert "| 2048x12x1 | 8.2 | 100.0 (12.2x) | 200.0 (24.4x) |  |" in summary
    assert "(5/10)" in summary and "2.00 (5/10)" in summary
    path = tmp_path / "2026-11-30-test.json"
    results.save(path, document)
    written = write_report(path)
    md = path.with_suffix(".md").read_text()
    assert "ragged: segment_ids only" in md and "33x2x3-ragged" in md
    assert path.with_suffix(".md") in written
    pytest.importorskip("matplotlib")
    assert path.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize(
    ("loop_calls", "seconds_per_call", "expected"),
    [
        (1000, 20e-6, 10),  # short calls: ten to an iteration, as the torch rows' graphs
        (1000, 500e-6, 4),  # 2 ms of device time an iteration is enough
        (20, 30e-3, 1),  # the XLA path's long calls are not unrolled
        (3, 1e-6, 3),  # never more than the loop runs
    ],
)
def test_gpu_loop_unrolls_only_short_calls(loop_calls, seconds_per_call, expected):
    from benchmarks.jax_measure import calls_per_iteration

    assert calls_per_iteration(loop_calls, seconds_per_call) == expected


def test_gpu_loop_keeps_every_calls_outputs():
    """Were only the last chained call's outputs kept, XLA would drop the others' output work
    (three dots an iteration would become one) and the loop would time too little."""
    import jax.numpy as jnp

    from benchmarks.jax_measure import chained_loop

    def step(args, state):
        return state + 1.0, ((args["x"] * state) @ args["w"],)  # a dot per call

    args = {"x": jnp.ones((64, 64)), "w": jnp.ones((64, 64))}
    outputs = ((jnp.zeros((64, 64)),),) * 3
    hlo = chained_loop(step, 3).lower(args, jnp.zeros(()), outputs, 2).compile().as_text()
    assert hlo.count(" dot(") == 3, hlo


def test_gpu_loop_hoists_nothing_of_a_call():
    """The steps tie the token inputs to the chained state, so work on them alone cannot leave
    the loop: a call whose dot reads only the inputs runs it once per chained call, and a NaN
    state reaches every output (0 * NaN is NaN)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.jax_measure import chained_loop, forward_step
    from benchmarks.native import Native

    def call(args, state):
        heavy = args["q"] @ args["k"]  # depends on the inputs alone
        return heavy + state, state + jnp.sum(heavy)

    native = Native("jax", {"q": jnp.ones((64, 64)), "k": jnp.ones((64, 64))}, 0.0, call, False, "")
    step, args = forward_step(native)
    outputs = ((jnp.zeros((64, 64)),),) * 3
    hlo = chained_loop(step, 3).lower(args, jnp.zeros(()), outputs, 2).compile().as_text()
    assert hlo.count(" dot(") == 3, hlo  # untied: one dot, hoisted before the loop
    _, (o,) = jax.jit(step)(args, jnp.float32(jnp.nan))
    assert bool(jnp.all(jnp.isnan(o)))


def test_kernel_profile_segment_counts_are_checked():
    import argparse

    from benchmarks.kernel_profile import _segment_counts, _short_name

    assert _segment_counts("1,2,16") == [1, 2, 16]
    for bad in ("0", "one", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integers"):
            _segment_counts(bad)
    name = "kernel_cutlass_chain_kernel_jax_kdakernels_KdaForwardSm90_object_at_tensor_1"
    assert _short_name(name) == "chain_kernel ...dSm90_object_at_tensor_1"
    assert _short_name("some_other_kernel") == "some_other_kernel"
    scan = (
        "kernel_cutlass_kernel_jax_kdasm90kernelskda_state_scan_tc_sm90ChunkStateScanTcSm90"
        "_object_at__tensorptrbf16gmemalign16o16384i64div163841638_0"
    )
    assert _short_name(scan) == "kda_state_scan_tc_sm90 ...6o16384i64div163841638_0"


def test_run_end_to_end_on_the_xla_backend(tmp_path):
    """benchmarks.run on this machine: one quick row, then --resume with nothing left to do,
    then --stop-after 0 on a new file: no row, but the report is written."""
    import json

    from benchmarks import run

    path = tmp_path / "quick.json"
    only = "33x2x3-ragged,jax_kda/xla"
    assert run.main(["--quick", "--only", only, "--output", str(path), "--seed", "3"]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["shape"], r["implementation"], r["status"]) for r in rows] == [
        ("33x2x3-ragged", "jax_kda/xla", "ok")
    ]
    assert 0 < max(rows[0]["rms_ratio"].values()) <= 1e-2
    assert path.with_suffix(".md").exists()
    assert run.main(["--quick", "--only", only, "--output", str(path), "--resume"]) == 0
    assert json.loads(path.read_text())["rows"] == rows

    stopped = tmp_path / "stopped.json"
    assert run.main(["--quick", "--only", only, "--output", str(stopped), "--stop-after", "0"]) == 0
    assert json.loads(stopped.read_text())["rows"] == []


def test_train_run_splits_the_step_into_forward_and_backward(tmp_path):
    """A --train row times the forward alone too; the report shows forward / backward."""
    import json

    from benchmarks import run

    path = tmp_path / "train.json"
    only = "33x2x3-ragged,jax_kda/xla"
    assert run.main(["--quick", "--train", "--only", only, "--output", str(path)]) == 0
    (row,) = json.loads(path.read_text())["rows"]
    assert row["status"] == "ok", row
    assert 0 < row["forward_gpu_us"] and row["backward_gpu_us"] == pytest.approx(
        row["gpu_us"] - row["forward_gpu_us"]
    )
    assert "Forward alone / backward" in path.with_suffix(".md").read_text()


def test_host_cost_measures_both_dispatches():
    """The host-cost tool runs on the XLA backend and reports both medians (no timing bar)."""
    import jax.numpy as jnp

    from benchmarks.host_cost import host_cost
    from jax_kda.oracle import production_inputs

    inputs = [jnp.asarray(a) for a in production_inputs([40, 9], 2, seed=0)]
    cost = host_cost(inputs, "xla", None, calls=5)
    assert cost.prefill_us > 0 and cost.trivial_us > 0
    assert cost.share_us == pytest.approx(cost.prefill_us - cost.trivial_us)
