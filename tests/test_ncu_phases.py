"""benchmarks.ncu_phases on a small hand-made export: phases cut at CTA barriers, shares of the
samples, each kernel read with its own columns."""

import csv

from benchmarks import ncu_phases


def _write(path, kernels):
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        for name, extra, rows in kernels:
            out.writerow(["Kernel Name", name])
            out.writerow(["Address", "Source", ncu_phases.SAMPLES, *extra, "stall_long_sb",
                          "stall_barrier"])  # fmt: skip
            for address, source, samples, long_sb, barrier in rows:
                out.writerow([address, source, samples, *["0"] * len(extra), long_sb, barrier])


def test_phases_are_cut_at_barriers_and_weighted_by_samples(tmp_path, capsys):
    path = tmp_path / "source.csv"
    first = [
        ("0x0", "      LDG.E.128 R4, desc[UR4][R2.64]", "6", "6", "0"),
        ("0x10", "@P0   STS.128 [R1], R4", "0", "0", "0"),
        ("0x20", "      BAR.SYNC.DEFER_BLOCKING 0x0", "2", "0", "2"),
        ("0x30", "      STG.E [R2.64], R5", "2", "1", "0"),
    ]
    # a second kernel with one more column before the stalls: read with its own header
    second = [("0x0", "      EXIT", "4", "3", "1")]
    _write(path, [("kernel_a", [], first), ("kernel_b", ["L2 Theoretical Sectors Local"], second)])
    kernels = ncu_phases.read_kernels(str(path))
    assert [k["name"] for k in kernels] == ["kernel_a", "kernel_b"]
    assert [len(p) for p in ncu_phases.phases(kernels[0]["rows"])] == [3, 1]
    assert ncu_phases.opcode("@!P1 STS.128 [R1], R4") == "STS.128"
    lines = ncu_phases.report(kernels[0])
    assert "4 instructions, 10 samples" in lines[0]
    assert " 80.0 %" in lines[1] and "long_sb:6" in lines[1] and "LDG:1" in lines[1]
    assert " 20.0 %" in lines[2] and "long_sb:1" in lines[2]
    assert "long_sb:3 barrier:1" in ncu_phases.report(kernels[1])[1]
