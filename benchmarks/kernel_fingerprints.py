"""Fingerprints of the sm90 kernels a default call runs: the SHA-256 of each exported artifact's
embedded cubin, with its registers and stack frame, compiled here for sm_90a (no GPU needed).

``python -m benchmarks.kernel_fingerprints [--save FILE] [--against FILE]`` prints them, saves
them as JSON, or compares them with a saved set and exits non-zero on a difference. The use: a
change that must leave the GPU-verified kernels alone (a new opt-in variant beside them, a
refactor of shared code) shows that it did, kernel by kernel, before any device time is spent;
a kernel whose fingerprint moved runs on the GPU again before it lands. Fingerprints hold for one
nvidia-cutlass-dsl version (saved beside them; a comparison across versions is refused). Run it
from the checkout it describes (``python -m``, so that ``jax_kda`` imports from there).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
from importlib import metadata

from jax_kda.sm90.kernels.layout import SCAN_TC_V_SLICES

# EIATTR attribute ids of a cubin's .nv.info sections (their format is 4: a 2-byte size, then
# the kernel's symbol index and a 4-byte value)
_REGCOUNT = 0x2F
_FRAME_SIZE = 0x11


def _sections(elf: bytes):
    """(name, offset, size) of every section of a 64-bit little-endian ELF image."""
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    entsize, count, names_index = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * entsize) for i in range(count)]
    names_at = headers[names_index][4]

    def name(offset):
        start = names_at + offset
        return elf[start : elf.index(b"\0", start)].decode()

    return [(name(h[0]), h[4], h[5]) for h in headers]


def cubin_of(object_bytes: bytes) -> bytes:
    """The device image inside an artifact's host object (the second ELF image in it)."""
    start = object_bytes.find(b"\x7fELF", 1)
    if start < 0:
        raise ValueError("no embedded cubin in this object")
    return object_bytes[start:]


def fingerprint(object_bytes: bytes) -> dict:
    """{'sha256': first 16 hex digits of the cubin's hash, 'registers', 'frame_bytes'}."""
    cubin = cubin_of(object_bytes)
    found = {"sha256": hashlib.sha256(cubin).hexdigest()[:16]}
    for name, offset, size in _sections(cubin):
        if name != ".nv.info":
            continue
        data, at = cubin[offset : offset + size], 0
        while at + 2 <= len(data):
            form, attribute = data[at], data[at + 1]
            if form != 4:  # no size field: a 2-byte value (or none) in a 4-byte entry
                at += 4
                continue
            length = struct.unpack_from("<H", data, at + 2)[0]
            if attribute in (_REGCOUNT, _FRAME_SIZE) and length >= 8:
                key = "registers" if attribute == _REGCOUNT else "frame_bytes"
                found[key] = struct.unpack_from("<I", data, at + 8)[0]
            at += 4 + length
    return found


def default_artifacts():
    """The artifacts a default call can run (forward with and without a gate bound, the
    training step's backward, decode) in the variants the plan picks from, for scale 0.3 and
    2 heads where those are compile-time constants."""
    from jax_kda import sm90

    scale = 0.3
    artifacts = [
        sm90.forward_artifact(2, scale),
        sm90.chunk_operands_artifact(scale, 1),
        sm90.chunk_operands_artifact(scale, 1, False),
        sm90.chunk_outputs_artifact(),
        sm90.dense_bwd_artifact(),
        sm90.tokens_bwd_artifact(scale),
        sm90.decayed_tokens_bwd_artifact(scale),
        sm90.state_cotangent_artifact(0),
        sm90.decode_artifact(scale, False),
        sm90.decode_artifact(scale, True),
    ]
    for v_slice in SCAN_TC_V_SLICES:
        artifacts += [
            sm90.state_scan_artifact(False, v_slice, True, 1),
            sm90.state_scan_artifact(True, v_slice, True, 1),
            sm90.state_scans_artifact(v_slice),
            sm90.state_cotangent_artifact(v_slice),
        ]
    return artifacts


def fingerprints() -> dict:
    return {
        "nvidia-cutlass-dsl": metadata.version("nvidia-cutlass-dsl"),
        "kernels": {a.prefix: fingerprint(a.object_bytes) for a in default_artifacts()},
    }


def compare(saved: dict, current: dict) -> list[str]:
    """The kernels whose fingerprints differ (or that only one side has), as lines to print."""
    if saved["nvidia-cutlass-dsl"] != current["nvidia-cutlass-dsl"]:
        raise ValueError(
            f"fingerprints from nvidia-cutlass-dsl {saved['nvidia-cutlass-dsl']} cannot be "
            f"compared with {current['nvidia-cutlass-dsl']}'s"
        )
    lines = []
    for name in sorted(set(saved["kernels"]) | set(current["kernels"])):
        before, after = saved["kernels"].get(name), current["kernels"].get(name)
        if before != after:
            lines.append(f"{name}: {before} -> {after}")
    return lines


def _main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save", help="write the fingerprints to this JSON file")
    parser.add_argument("--against", help="compare with the fingerprints in this JSON file")
    options = parser.parse_args()
    current = fingerprints()
    for name, found in current["kernels"].items():
        print(f"{name:48s} {found}")
    if options.save:
        with open(options.save, "w") as f:
            json.dump(current, f, indent=1, sort_keys=True)
            f.write("\n")
    if options.against:
        with open(options.against) as f:
            moved = compare(json.load(f), current)
        print("\n".join(moved) if moved else f"every kernel as in {options.against}")
        sys.exit(1 if moved else 0)


if __name__ == "__main__":
    _main()
