"""The results JSON: where it lives, how rows are keyed and resumed, and the summary statistics.

A document is ``{"mode", "device", "date", "environment", "seed", "rows": [...]}``; a row is one
(shape, implementation) with ``status`` "ok", "unavailable" (the peer is missing or declines the
call: ``reason`` says why) or "failed" (it raised: ``reason`` holds the error).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from benchmarks.shapes import SPEC_SHAPES

RESULTS_DIR = Path(__file__).parent / "results"
SPEC_SHAPE_NAMES = tuple(shape.name for shape in SPEC_SHAPES)


def device_slug(device_kind: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``, ``"cpu"`` -> ``"cpu"``: the device part of a file name."""
    words = re.findall(r"[a-z0-9]+", device_kind.lower())
    return "-".join(w for w in words if w != "nvidia") or "device"


def default_path(date: str, device_kind: str, mode: str) -> Path:
    suffix = "" if mode == "forward" else f"-{mode}"
    return RESULTS_DIR / f"{date}-{device_slug(device_kind)}{suffix}.json"


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def save(path: Path, document: dict) -> None:
    """Write atomically, so a run killed mid-write leaves the previous rows intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(document, indent=1) + "\n")
    os.replace(partial, path)


def finished(document: dict) -> set[tuple[str, str]]:
    """(shape, implementation) pairs already measured: ``--resume`` skips them. Unavailable and
    failed rows are tried again (they cost little, and the reason may have gone)."""
    return {(r["shape"], r["implementation"]) for r in document["rows"] if r["status"] == "ok"}


def upsert(document: dict, row: dict) -> None:
    """Replace the row with the same (shape, implementation), or append it."""
    key = (row["shape"], row["implementation"])
    rows = [r for r in document["rows"] if (r["shape"], r["implementation"]) != key]
    document["rows"] = [*rows, row]


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def gpu_times(document: dict, implementation: str) -> dict[str, float]:
    """shape name -> GPU time (us) of the implementation's ok rows."""
    return {
        r["shape"]: r["gpu_us"]
        for r in document["rows"]
        if r["implementation"] == implementation and r["status"] == "ok"
    }


def spec_geomean(document: dict, implementation: str) -> tuple[float, int]:
    """Geomean GPU time over SPEC's ten shapes, and how many of the ten it covers."""
    times = gpu_times(document, implementation)
    covered = [times[name] for name in SPEC_SHAPE_NAMES if name in times]
    return geomean(covered), len(covered)


def spec_ratio(document: dict, implementation: str, reference: str) -> tuple[float, int]:
    """Geomean over SPEC's shapes both ran of implementation time / reference time (> 1: slower)."""
    times, ref = gpu_times(document, implementation), gpu_times(document, reference)
    shared = [name for name in SPEC_SHAPE_NAMES if name in times and name in ref]
    return geomean(times[n] / ref[n] for n in shared), len(shared)
