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
        (1000, 2e-6, 50),  # a decode step: many to an executable, so dispatch hides behind them
        (1000, 100e-6, 20),  # about 2 ms of device time an executable
        (1000, 500e-6, 4),
        (20, 30e-3, 1),  # the XLA path's long calls are not repeated inside one executable
        (3, 1e-6, 3),  # never more than the measurement runs
    ],
)
def test_gpu_executable_repeats_only_short_calls(loop_calls, seconds_per_call, expected):
    from benchmarks.jax_measure import calls_per_execution

    assert calls_per_execution(loop_calls, seconds_per_call) == expected


def _input_only_call(args, state):
    """A call whose heavy part (a dot) reads the inputs alone: were two calls' inputs the same
    buffers, XLA would compute it once for both."""
    import jax.numpy as jnp

    heavy = args["q"] @ args["k"]
    return heavy + state, state + jnp.sum(heavy)


def test_chained_calls_run_every_calls_work_and_keep_every_calls_outputs():
    """Each chained call reads its own copy of the inputs, so XLA neither merges the identical
    input-only work of the calls nor drops any call's outputs: three calls, three dots."""
    import jax
    import jax.numpy as jnp

    from benchmarks.jax_measure import chained_calls, distinct_copies, forward_step
    from benchmarks.native import Native

    args = {"q": jnp.ones((64, 64)), "k": jnp.ones((64, 64))}
    step, step_args = forward_step(Native("jax", args, 0.0, _input_only_call, False, ""))
    copies = distinct_copies(step_args, 3)
    hlo = chained_calls(step).lower(copies, jnp.zeros(())).compile().as_text()
    assert hlo.count(" dot(") == 3, hlo
    assert " while(" not in hlo  # no device loop whose condition waits on the host

    @jax.jit
    def same_inputs(args, state):  # the three calls on one set of inputs: one dot
        outputs = []
        for _ in range(3):
            state, o = step(args, state)
            outputs.append(o)
        return state, outputs

    assert same_inputs.lower(step_args, jnp.zeros(())).compile().as_text().count(" dot(") == 1
    # the copies hold the same values in buffers of their own, and chaining reaches every call
    pointers = {c["q"].unsafe_buffer_pointer() for c in copies}
    assert len(pointers) == 3
    for c in copies[1:]:
        assert bool(jnp.all(c["q"] == step_args["q"]))
    state, outputs = chained_calls(step)(copies, jnp.float32(1.0))
    assert len(outputs) == 3
    heavy = 64.0 * 64 * 64
    assert float(state) == 1.0 + 3 * heavy
    assert float(outputs[2][0][0, 0]) == 64.0 + 1.0 + 2 * heavy


def test_torch_graph_copies_are_distinct_and_keep_gradients():
    torch = pytest.importorskip("torch")
    from benchmarks.torch_measure import _distinct_copies

    args = {"q": torch.ones(4, requires_grad=True), "cu": torch.zeros(2), "name": "plan"}
    copies = _distinct_copies(torch, args, 3)
    assert copies[0] is args
    assert len({c["q"].data_ptr() for c in copies}) == 3
    assert all(c["q"].requires_grad and not c["cu"].requires_grad for c in copies)
    assert all(c["name"] == "plan" for c in copies)


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


def test_prep_cost_inputs_are_raw_and_prepare_as_prefill_states():
    """benchmarks.prep_cost's raw inputs are unnormalised, a gate projection and beta logits;
    its prepared-ahead row's inputs are the XLA preparation of them (unit q and k rows, g <= 0
    from fla's softplus gate, beta in (0, 1)), heads and shapes kept."""
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.prep_cost import prepare, raw_inputs

    raw = raw_inputs([5, 0, 70], 3, seed=1)
    assert raw["q"].shape == (75, 3, 128) and raw["beta"].shape == (75, 3)
    assert raw["cu_seqlens"].tolist() == [0, 5, 5, 75]
    norms = np.linalg.norm(np.asarray(raw["q"], np.float32), axis=-1)
    assert norms.min() > 5  # raw: far from unit rows
    ready = prepare(raw)
    for name in ("q", "k"):
        rows = np.linalg.norm(np.asarray(ready[name], np.float32), axis=-1)
        np.testing.assert_allclose(rows, 1.0, atol=1e-2)
    assert float(jnp.max(ready["g"])) <= 0.0 and float(jnp.min(ready["g"])) < -0.5
    beta = np.asarray(ready["beta"])
    assert beta.min() > 0 and beta.max() < 1 and (beta < 0.5).any() and (beta > 0.5).any()
