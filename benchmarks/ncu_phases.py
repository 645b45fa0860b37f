"""Where a kernel's warps wait, phase by phase: Nsight Compute's source page (SASS, one row an
instruction) split at every CTA barrier.

The per-chunk kernels run their phases (loads, operand images, products, stores) one after
another with a CTA barrier between them, so the SASS between two BAR.SYNC is one phase. For
each kernel in the export this prints, per phase, its share of the kernel's warp-stall samples,
its instruction mix and its three largest stall reasons.

    ncu --set full -k regex:chunk_operands -o step python ...
    ncu --import step.ncu-rep --page source --csv --print-source sass > step.csv
    python -m benchmarks.ncu_phases step.csv [--kernel chunk_operands]
"""

from __future__ import annotations

import argparse
import collections
import csv
import re

SAMPLES = "Warp Stall Sampling (All Samples)"


def read_kernels(path: str) -> list[dict]:
    """The export's kernels: name, header (each kernel has its own columns) and SASS rows."""
    kernels: list[dict] = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                kernels.append({"name": row[1], "header": None, "rows": []})
            elif row[0] == "Address" and kernels:
                kernels[-1]["header"] = row
            elif kernels and kernels[-1]["header"] is not None and len(row) > 2:
                kernels[-1]["rows"].append(row)
    return kernels


def opcode(source: str) -> str:
    """'@!P0 LDG.E.128 R4, ...' -> 'LDG.E.128'."""
    text = re.sub(r"^@!?U?P[T0-9]+\s+", "", source.strip())
    return text.split(" ")[0]


def phases(rows: list[list[str]]) -> list[list[list[str]]]:
    """The SASS rows cut after every BAR.SYNC."""
    out, current = [], []
    for row in rows:
        current.append(row)
        if opcode(row[1]).startswith("BAR.SYNC"):
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def report(kernel: dict) -> list[str]:
    header = kernel["header"]
    samples = header.index(SAMPLES)
    stalls = [
        (i, name[len("stall_") :])
        for i, name in enumerate(header)
        if name.startswith("stall_") and "Not Issued" not in name
    ]

    def count(row, i):
        return int(row[i] or 0) if i < len(row) and row[i].strip().isdigit() else 0

    total = sum(count(r, samples) for r in kernel["rows"]) or 1
    lines = [f"{kernel['name'][:100]}: {len(kernel['rows'])} instructions, {total} samples"]
    for n, phase in enumerate(phases(kernel["rows"])):
        share = sum(count(r, samples) for r in phase) / total
        ops = collections.Counter(opcode(r[1]).split(".")[0] for r in phase)
        waits = collections.Counter()
        for r in phase:
            for i, name in stalls:
                waits[name] += count(r, i)
        mix = " ".join(f"{o}:{c}" for o, c in ops.most_common(6))
        top = " ".join(f"{o}:{c}" for o, c in waits.most_common(3))
        lines.append(f"{n:3d} {len(phase):5d} instr {100 * share:5.1f} % | {mix} || {top}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--kernel", default="", help="only kernels whose name contains this")
    args = parser.parse_args()
    for kernel in read_kernels(args.csv):
        if args.kernel in kernel["name"] and kernel["header"] is not None:
            print("\n".join(report(kernel)))
            print()


if __name__ == "__main__":
    main()
