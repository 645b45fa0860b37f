"""``python -m benchmarks.run``: measure jax_kda and the peers, shape by shape, into one JSON.

Per shape and implementation: GPU time per call, per-call time from Python, pipelined time,
first-call time, device memory of one call, and accuracy against the float64 oracle. Rows are saved
as they finish, so ``--resume`` continues a run that was cut off (or split with ``--only``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib.metadata
import platform
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import jax
import numpy as np

import jax_kda
from benchmarks import jax_measure, results
from benchmarks.accuracy import choose_sample, oracle_outputs, packed_outputs, rms_ratios
from benchmarks.adapters import IMPLEMENTATION_NAMES, implementation
from benchmarks.hbm import hbm_floor_us
from benchmarks.inputs import shape_cotangents, shape_inputs, shape_seed
from benchmarks.native import Unavailable
from benchmarks.report import markdown_summary, write_report
from benchmarks.selection import parse_only, select
from benchmarks.shapes import ALL_SHAPES, QUICK_SHAPE_NAMES, Shape, shape_by_name
from benchmarks.timing import FULL, QUICK, Settings

PEER_DISTRIBUTIONS = (
    "nvidia-cudnn-frontend",
    "fla-core",
    "jax-linear-attention",
    "torch",
    "triton",
)


def main(argv=None) -> int:
    args = _parse_args(argv)
    mode = "train" if args.train else "forward"
    settings = QUICK if args.quick else FULL
    pool = [shape_by_name(n) for n in QUICK_SHAPE_NAMES] if args.quick else list(ALL_SHAPES)
    shapes, names = select(parse_only(args.only), pool, IMPLEMENTATION_NAMES)
    device = jax.devices()[0]
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    path = (
        Path(args.output) if args.output else results.default_path(date, device.device_kind, mode)
    )

    document = results.load(path) if args.resume else None
    if document is None:
        document = _new_document(mode, device, date, settings, args.seed)
    elif document["mode"] != mode:
        raise SystemExit(f"--resume: {path} holds {document['mode']!r} rows, this run is {mode!r}")
    done = results.finished(document) if args.resume else set()
    results.save(path, document)  # a run stopped before its first row still leaves a valid file

    plan = [(s, n) for s in shapes for n in names if (s.name, n) not in done]
    print(
        f"benchmarks.run: {mode}, {len(plan)} rows ({len(shapes)} shapes x {len(names)} "
        f"implementations, {len(shapes) * len(names) - len(plan)} already done) on "
        f"{device.device_kind}; results -> {path}",
        flush=True,
    )
    start = time.perf_counter()
    data = None
    for index, (shape, name) in enumerate(plan, 1):
        elapsed = time.perf_counter() - start
        if args.stop_after is not None and elapsed >= args.stop_after:
            print(
                f"--stop-after {args.stop_after:.0f} s: stopping after {index - 1} of {len(plan)} "
                f"rows ({elapsed:.0f} s); --resume carries on",
                flush=True,
            )
            break
        if data is None or data.shape is not shape:
            data = None  # free the previous shape's inputs before making the next one's
            data = ShapeData(shape, mode, document["seed"])
        row = _measure_row(shape, name, data, settings)
        results.upsert(document, row)
        results.save(path, document)
        print(f"[{index}/{len(plan)} {time.perf_counter() - start:6.0f}s] {_progress(row)}")
        sys.stdout.flush()

    written = write_report(path)
    print("\n" + markdown_summary(document))
    print("wrote " + ", ".join(str(p) for p in [path, *written]))
    return 0


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument(
        "--only",
        help="comma-separated shapes (2048x12x1), groups (spec, flashkda, edge) and "
        "implementations (jax_kda/xla, or a part: xla, cudnn, kda_hopper_cuda, fla, jla)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="keep the output's rows; skip those already ok"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: two small shapes, few calls"
    )
    parser.add_argument(
        "--train", action="store_true", help="time forward + backward (a training step)"
    )
    parser.add_argument(
        "--output",
        help="results JSON (default benchmarks/results/DATE-DEVICE[-train].json); the .md and "
        ".png are written beside it",
    )
    parser.add_argument(
        "--stop-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no new row after this many seconds (the report is still written), so a run "
        "ends inside a time limit; leave room for one row (up to ~90 s: fla's autotuning)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="data seed (default: fresh each run; a resumed run keeps its document's seed)",
    )
    return parser.parse_args(argv)


def _new_document(mode: str, device, date: str, settings: Settings, seed: int | None) -> dict:
    if seed is None:
        seed = int(np.random.SeedSequence().generate_state(1)[0])
    return {
        "mode": mode,
        "device": device.device_kind,
        "date": date,
        "seed": seed,
        "settings": asdict(settings),
        "environment": _environment(),
        "rows": [],
    }


def _environment() -> dict[str, str]:
    versions = {"python": platform.python_version(), "jax": jax.__version__}
    versions["jax_kda"] = jax_kda.__version__
    for distribution in PEER_DISTRIBUTIONS:
        try:
            versions[distribution] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            versions[distribution] = "not installed"
    return versions


class ShapeData:
    """One shape's inputs, made once and shared by every implementation; the oracle's sample
    outputs are computed on first use (a shape whose peers are all unavailable never needs them)."""

    def __init__(self, shape: Shape, mode: str, run_seed: int):
        self.shape = shape
        self.seed = shape_seed(run_seed, shape)
        self.inputs = shape_inputs(shape, self.seed)
        self.cotangents = shape_cotangents(shape, self.seed) if mode == "train" else None
        self.sample = choose_sample(self.inputs)

    @functools.cached_property
    def oracle(self) -> dict[str, np.ndarray]:
        return oracle_outputs(self.inputs, self.sample, self.cotangents)


def _measure_row(shape: Shape, name: str, data: ShapeData, settings: Settings) -> dict:
    floor = hbm_floor_us(shape.total_tokens, shape.heads, shape.num_sequences)
    row = {
        "shape": shape.name,
        "implementation": name,
        "group": shape.group,
        "lengths": list(shape.lengths),
        "heads": shape.heads,
        "seed": data.seed,
        "hbm_floor_us": floor,
    }
    try:
        native = implementation(name).bind(data.inputs)
    except Unavailable as err:
        return {**row, "status": "unavailable", "reason": str(err)}
    except Exception as err:
        traceback.print_exc()
        return {**row, "status": "failed", "reason": f"binding the inputs: {err!r}"}
    row["notes"] = native.notes
    try:
        measure = jax_measure if native.framework == "jax" else _torch_measure()
        if data.cotangents is None:
            step, step_args = measure.forward_step(native)
        else:
            step, step_args = measure.train_step(native, data.cotangents)
        timings, first_result = measure.measure(step, step_args, native.initial_state, settings)
        outputs = packed_outputs(native, data.inputs, first_result)
        ratios = rms_ratios(outputs, data.oracle, data.sample)
        split = {}
        if data.cotangents is not None:  # the step's forward alone, so backward = step - it
            forward, forward_args = measure.forward_step(native)
            forward_timings, _ = measure.measure(
                forward, forward_args, native.initial_state, settings
            )
            split = {
                "forward_gpu_us": forward_timings.gpu_us,
                "backward_gpu_us": timings.gpu_us - forward_timings.gpu_us,
            }
    except Exception as err:
        traceback.print_exc()
        return {**row, "status": "failed", "reason": f"{err!r}"[:2000]}
    finally:
        del native
        _release_device_memory()
    return {
        **row,
        "status": "ok",
        **asdict(timings),
        **split,
        "hbm_floor_ratio": timings.gpu_us / floor,
        "rms_ratio": ratios,
        "accuracy_sample": data.sample.describe(),
    }


def _torch_measure():
    """The torch measurement module, imported only when a torch peer has bound."""
    from benchmarks import torch_measure

    return torch_measure


def _release_device_memory() -> None:
    """Drop the finished row's buffers, so the next implementation starts with the GPU free."""
    gc.collect()
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _progress(row: dict) -> str:
    head = f"{row['shape']:>18} {row['implementation']:<22}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row['reason'][:300]}"
    errors = " ".join(f"{k} {v:.1e}" for k, v in row["rms_ratio"].items())
    return (
        f"{head} gpu {row['gpu_us']:9.1f} us ({row['hbm_floor_ratio']:5.1f}x floor)  "
        f"per-call {row['per_call_us']:9.1f} us  pipelined {row['pipelined_us']:9.1f} us  "
        f"first {row['first_call_ms']:8.0f} ms  rms_ratio {errors}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
