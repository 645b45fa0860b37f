"""The markdown table and the plot of a results JSON.

``python -m benchmarks.report benchmarks/results/2026-11-30-h200.json`` rewrites the ``.md`` and
``.png`` beside the JSON (``benchmarks.run`` calls the same code at the end of a run).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from benchmarks import results
from benchmarks.adapters import IMPLEMENTATION_NAMES, REFERENCE_ORDER
from benchmarks.shapes import ALL_SHAPES

_SHAPE_ORDER = [shape.name for shape in ALL_SHAPES]


def _implementations(document: dict) -> list[str]:
    present = {r["implementation"] for r in document["rows"]}
    return [name for name in IMPLEMENTATION_NAMES if name in present]


def _shapes(document: dict) -> list[str]:
    present = {r["shape"] for r in document["rows"]}
    return [name for name in _SHAPE_ORDER if name in present]


def _rows_by_key(document: dict) -> dict[tuple[str, str], dict]:
    return {(r["shape"], r["implementation"]): r for r in document["rows"]}


def reference_implementation(document: dict) -> str | None:
    """The jax_kda backend the ratios are taken against: the first of REFERENCE_ORDER with rows."""
    return next((n for n in REFERENCE_ORDER if results.gpu_times(document, n)), None)


def _floor(rows: dict, shape: str) -> float:
    return next(r["hbm_floor_us"] for (s, _), r in rows.items() if s == shape)


def markdown_summary(document: dict) -> str:
    """GPU time per shape and implementation, the geomean over SPEC's ten shapes, and the ratios."""
    forward = document["mode"] == "forward"
    impls, shapes, rows = _implementations(document), _shapes(document), _rows_by_key(document)
    header = ["T x H x N", *(["HBM floor"] if forward else []), *impls]
    lines = [
        "GPU time per call, us" + (" (x HBM floor)" if forward else "") + "; - = unavailable "
        "or failed (see below)",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for shape in shapes:
        floor = _floor(rows, shape)
        cells = [shape, *([f"{floor:.1f}"] if forward else [])]
        for impl in impls:
            row = rows.get((shape, impl))
            if row is None:
                cells.append("")
            elif row["status"] != "ok":
                cells.append("-")
            else:
                ratio = f" ({row['gpu_us'] / floor:.1f}x)" if forward else ""
                cells.append(f"{row['gpu_us']:.1f}{ratio}")
        lines.append("| " + " | ".join(cells) + " |")

    floors = [_floor(rows, s) for s in results.SPEC_SHAPE_NAMES if s in shapes]
    geomean_cells = [
        "geomean, SPEC's ten",
        *([f"{results.geomean(floors):.1f}" if floors else ""] if forward else []),
    ]
    for impl in impls:
        value, covered = results.spec_geomean(document, impl)
        geomean_cells.append(_with_coverage(value, covered))
    lines.append("| " + " | ".join(geomean_cells) + " |")
    reference = reference_implementation(document)
    if reference is not None:
        ratio_cells = [f"x {reference}, SPEC's ten", *([""] if forward else [])]
        for impl in impls:
            value, covered = results.spec_ratio(document, impl, reference)
            ratio_cells.append(_with_coverage(value, covered, digits=2))
        lines.append("| " + " | ".join(ratio_cells) + " |")
    return "\n".join(lines) + "\n"


def split_summary(document: dict) -> str:
    """A training run's step split, per shape and implementation: forward alone / backward
    (the step minus the forward, both GPU times of the same row), us; empty when no row has
    the split."""
    impls, shapes, rows = _implementations(document), _shapes(document), _rows_by_key(document)
    if not any("backward_gpu_us" in r for r in document["rows"]):
        return ""
    lines = [
        "Forward alone / backward (step - forward), GPU us",
        "",
        "| T x H x N | " + " | ".join(impls) + " |",
        "|" + "---|" * (len(impls) + 1),
    ]
    for shape in shapes:
        cells = [shape]
        for impl in impls:
            row = rows.get((shape, impl))
            ok = row is not None and row["status"] == "ok" and "backward_gpu_us" in row
            cells.append(
                f"{row['forward_gpu_us']:.1f} / {row['backward_gpu_us']:.1f}" if ok else ""
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _with_coverage(value: float, covered: int, digits: int = 1) -> str:
    if covered == 0 or math.isnan(value):
        return ""
    total = len(results.SPEC_SHAPE_NAMES)
    return f"{value:.{digits}f}" + ("" if covered == total else f" ({covered}/{total})")


def _details(document: dict) -> str:
    lines = [
        "| shape | implementation | GPU us | per call us | pipelined us | first call ms | "
        "peak MiB | rms_ratio vs float64 oracle |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = _rows_by_key(document)
    for shape in _shapes(document):
        for impl in _implementations(document):
            row = rows.get((shape, impl))
            if row is None or row["status"] != "ok":
                continue
            peak = "" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**20:.0f}"
            errors = ", ".join(f"{k} {v:.1e}" for k, v in row["rms_ratio"].items())
            lines.append(
                f"| {shape} | {impl} | {row['gpu_us']:.1f} | {row['per_call_us']:.1f} | "
                f"{row['pipelined_us']:.1f} | {row['first_call_ms']:.0f} | {peak} | {errors} |"
            )
    return "\n".join(lines) + "\n"


def _problems(document: dict) -> str:
    """Unavailable and failed rows, one line per (implementation, status, reason)."""
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for row in document["rows"]:
        if row["status"] != "ok":
            key = (row["implementation"], row["status"], row["reason"])
            grouped.setdefault(key, []).append(row["shape"])
    if not grouped:
        return "None.\n"
    return "".join(
        f"- **{impl}** {status} on {', '.join(shapes)}: {reason}\n"
        for (impl, status, reason), shapes in grouped.items()
    )


def _methods(document: dict) -> str:
    """How each implementation was called and timed (from its first row that says)."""
    lines = []
    for impl in _implementations(document):
        rows = [r for r in document["rows"] if r["implementation"] == impl and "notes" in r]
        if not rows:
            continue
        ok = [r for r in rows if r["status"] == "ok"]
        timing = f" GPU time: {ok[0]['gpu_method']}; memory: {ok[0]['peak_method']}." if ok else ""
        lines.append(f"- **{impl}**: `{rows[0]['notes']}`.{timing}")
    return "\n".join(lines) + "\n"


def markdown(document: dict, plot_name: str | None) -> str:
    environment = ", ".join(f"{k} {v}" for k, v in document["environment"].items())
    title = "Training step (forward + backward)" if document["mode"] == "train" else "Forward"
    samples = sorted({r["accuracy_sample"] for r in document["rows"] if r["status"] == "ok"})
    parts = [
        f"# {title}: jax_kda and peers on {document['device']}, {document['date']}\n",
        f"Environment: {environment}. Data seed {document['seed']} (production gate, lb = -5, "
        "non-zero initial state; every implementation gets the same data). HBM floor: q, k, v "
        "(bf16), g, beta (f32) read once, o (bf16) written once, states (f32) in and out, at "
        "4.8 TB/s.\n",
        markdown_summary(document),
        *([split_summary(document)] if split_summary(document) else []),
        *([f"![GPU time per shape]({plot_name})\n"] if plot_name else []),
        "## All measurements\n",
        "Per call: a jitted call (JAX) or an eager call (torch) from Python, waited for, median. "
        "Pipelined: calls issued back to back, one wait, divided by the count. First call: "
        "compilation, autotuning or graph building plus one run. Accuracy sample: "
        + ("; ".join(sorted({s.split(" (")[0] for s in samples})) if samples else "none")
        + " - each row's sequence in full, heads first and last.\n",
        _details(document),
        "## Unavailable and failed\n",
        _problems(document),
        "## How each implementation was called\n",
        _methods(document),
    ]
    return "\n".join(parts)


def plot(document: dict, path: Path) -> None:
    """Log-scale GPU time per shape, one line per implementation (and the HBM floor)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes, rows = _shapes(document), _rows_by_key(document)
    positions = range(len(shapes))
    figure, axes = plt.subplots(figsize=(max(8, 0.6 * len(shapes) + 3), 5))
    if document["mode"] == "forward":
        floors = [_floor(rows, s) for s in shapes]
        axes.plot(positions, floors, "k--", label="HBM floor")
    for impl in _implementations(document):
        times = [
            rows[(s, impl)]["gpu_us"]
            if (s, impl) in rows and rows[(s, impl)]["status"] == "ok"
            else math.nan
            for s in shapes
        ]
        if not all(math.isnan(t) for t in times):
            axes.plot(positions, times, "o-", label=impl)
    axes.set_yscale("log")
    axes.set_xticks(list(positions), shapes, rotation=60, ha="right")
    axes.set_ylabel("GPU time per call (us)")
    axes.set_title(f"KDA {document['mode']} on {document['device']}, {document['date']}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_report(json_path: Path) -> list[Path]:
    """Write the .md (and the .png, where matplotlib is installed) beside ``json_path``."""
    document = results.load(json_path)
    png = json_path.with_suffix(".png")
    try:
        plot(document, png)
    except ImportError:
        png = None
    md = json_path.with_suffix(".md")
    md.write_text(markdown(document, png.name if png else None))
    return [md, *([png] if png else [])]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__)
    parser.add_argument("json", type=Path, nargs="+", help="results JSON file(s)")
    for path in parser.parse_args(argv).json:
        print("wrote " + ", ".join(str(p) for p in write_report(path)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
