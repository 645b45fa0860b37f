"""benchmarks.kernel_fingerprints: an exported kernel's cubin facts and the comparison of two
fingerprint sets (compiled for sm_90a here, no GPU needed)."""

import json
from pathlib import Path

import pytest

from benchmarks.kernel_fingerprints import compare, cubin_facts, cubin_of, default_artifacts
from jax_kda import sm90

SAVED = Path(__file__).parent.parent / "benchmarks/results"


def test_cubin_facts_read_the_hash_registers_and_frame():
    artifact = sm90.chunk_outputs_artifact()
    found = cubin_facts(artifact.object_bytes)
    assert cubin_of(artifact.object_bytes)[:4] == b"\x7fELF"
    assert len(found["cubin_sha256"]) == 16
    # a real register count (a warpgroup kernel: at most 255) and no stack frame
    assert 32 <= found["registers"] <= 255 and found["frame_bytes"] == 0
    other = cubin_facts(sm90.dense_bwd_artifact().object_bytes)  # another kernel, another hash
    assert other["cubin_sha256"] != found["cubin_sha256"]
    with pytest.raises(ValueError, match="no embedded cubin"):
        cubin_of(b"\x7fELF" + b"\0" * 64)


def test_compare_names_every_moved_added_or_dropped_kernel_and_refuses_other_versions():
    a = {"ptx_sha256": "0" * 16, "cubin_sha256": "2" * 16, "registers": 100, "frame_bytes": 0}
    b = {**a, "ptx_sha256": "1" * 16, "cubin_sha256": "4" * 16}  # moved
    c = {**a, "cubin_sha256": "3" * 16}  # ptxas's own variation: the same kernel
    d = {**a, "ptx_sha256": "5" * 16}  # PTX renamed, the same binary: the same kernel
    saved = {"nvidia-cutlass-dsl": "4.8.1", "kernels": {"x": a, "y": a, "z": a, "w": a, "gone": a}}
    current = {"nvidia-cutlass-dsl": "4.8.1", "kernels": {"x": a, "y": b, "z": c, "w": d, "new": a}}
    moved = compare(saved, current)
    assert [line.split(":")[0] for line in moved] == ["gone", "new", "y"]
    assert compare(saved, saved) == []
    with pytest.raises(ValueError, match="cannot be compared"):
        compare(saved, {**current, "nvidia-cutlass-dsl": "4.9.0"})


def test_the_saved_verified_set_covers_the_default_kernels():
    """The committed fingerprints of the GPU-verified kernels (commit a38345f's tree) name every
    kernel the tool fingerprints today, each with its PTX hash and cubin facts."""
    saved = json.loads((SAVED / "2026-12-07-kernel-fingerprints-a38345f.json").read_text())
    assert saved["nvidia-cutlass-dsl"]
    kernels = saved["kernels"]
    assert set(kernels) == {make().prefix for make in default_artifacts()}
    for found in kernels.values():
        assert set(found) == {"ptx_sha256", "cubin_sha256", "registers", "frame_bytes"}
