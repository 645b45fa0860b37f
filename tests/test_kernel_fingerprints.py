"""benchmarks.kernel_fingerprints: the cubin fingerprint of an exported kernel and the comparison
of two sets (compiled for sm_90a here, no GPU needed)."""

import json
from pathlib import Path

import pytest

from benchmarks.kernel_fingerprints import compare, cubin_of, default_artifacts, fingerprint
from jax_kda import sm90

SAVED = Path(__file__).parent.parent / "benchmarks/results"


def test_fingerprint_reads_the_cubins_hash_registers_and_frame():
    artifact = sm90.chunk_outputs_artifact()
    found = fingerprint(artifact.object_bytes)
    assert cubin_of(artifact.object_bytes)[:4] == b"\x7fELF"
    assert len(found["sha256"]) == 16
    # a real register count (a warpgroup kernel: at most 255) and no stack frame
    assert 32 <= found["registers"] <= 255 and found["frame_bytes"] == 0
    # another kernel, another hash
    other = fingerprint(sm90.dense_bwd_artifact().object_bytes)
    assert other["sha256"] != found["sha256"]
    with pytest.raises(ValueError, match="no embedded cubin"):
        cubin_of(b"\x7fELF" + b"\0" * 64)


def test_compare_names_every_moved_added_or_dropped_kernel_and_refuses_other_versions():
    a = {"sha256": "0" * 16, "registers": 100, "frame_bytes": 0}
    b = {**a, "sha256": "1" * 16}
    saved = {"nvidia-cutlass-dsl": "4.8.1", "kernels": {"x": a, "y": a, "gone": a}}
    current = {"nvidia-cutlass-dsl": "4.8.1", "kernels": {"x": a, "y": b, "new": a}}
    moved = compare(saved, current)
    assert [line.split(":")[0] for line in moved] == ["gone", "new", "y"]
    assert compare(saved, saved) == []
    with pytest.raises(ValueError, match="cannot be compared"):
        compare(saved, {**current, "nvidia-cutlass-dsl": "4.9.0"})


def test_the_saved_verified_set_covers_the_default_kernels():
    """The committed fingerprints of the GPU-verified kernels (commit 3baf6c2's tree) name every
    kernel the tool fingerprints today, each with a hash, registers and frame."""
    saved = json.loads((SAVED / "2026-12-06-kernel-fingerprints-3baf6c2.json").read_text())
    assert saved["nvidia-cutlass-dsl"]
    kernels = saved["kernels"]
    assert set(kernels) == {artifact.prefix for artifact in default_artifacts()}
    for found in kernels.values():
        assert set(found) == {"sha256", "registers", "frame_bytes"}
