"""Fingerprints of the sm90 kernels a default call runs: the SHA-256 of the PTX each one compiles
to here for sm_90a (no GPU needed), with the registers and stack frame of its cubin.

``python -m benchmarks.kernel_fingerprints [--save FILE] [--against FILE]`` prints them, saves
them as JSON, or compares them with a saved set and exits non-zero when a kernel moved (its PTX
and its cubin both differ). The
use: a change that must leave the GPU-verified kernels alone (a new opt-in variant beside them,
a refactor of shared code) shows that it did, kernel by kernel, before any device time is spent;
a kernel whose fingerprint moved runs on the GPU again before it lands.

Why both: the PTX is what our code decides, but ptxas does not always turn the same PTX into
the same cubin (compiled again in a fresh process, the fused decayed+tokens backward and the
m64 wgmma scan each came out as one of several binaries, PTX identical; nvidia-cutlass-dsl
4.8.1), and code moved between methods can rename values in the PTX while ptxas makes the same
binary of it. Either hash unchanged means the kernel is the one that was verified. The kernels
are compiled in a child process with a private kernel cache (the DSL reads its dump settings
when it loads), from the checkout this module is in. Fingerprints hold for one
nvidia-cutlass-dsl version (saved beside them; a comparison across versions is refused).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

# EIATTR attribute ids of a cubin's .nv.info section (their format is 4: a 2-byte size, then
# the kernel's symbol index and a 4-byte value)
_REGCOUNT = 0x2F
_FRAME_SIZE = 0x11
_ROOT = Path(__file__).resolve().parent.parent


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


def cubin_facts(object_bytes: bytes) -> dict:
    """{'cubin_sha256': first 16 hex digits, 'registers', 'frame_bytes'} of an artifact."""
    cubin = cubin_of(object_bytes)
    found = {"cubin_sha256": hashlib.sha256(cubin).hexdigest()[:16]}
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
    2 heads where those are compile-time constants. Each is compiled when first asked for."""
    from jax_kda import sm90
    from jax_kda.sm90.kernels.input_prep import InputPrep
    from jax_kda.sm90.kernels.layout import SCAN_TC_V_SLICES

    scale = 0.3
    makers = [
        lambda: sm90.forward_artifact(2, scale),
        lambda: sm90.chunk_operands_artifact(scale, 1),
        # the training step's (gamma unwritten: the fused backward sums g itself)
        lambda: sm90.chunk_operands_artifact(scale, 1, keep_gamma=False),
        lambda: sm90.chunk_operands_artifact(scale, 1, False),
    ]
    # the forward-alone core preparing the raw inputs (a sample of IN_KERNEL_PREPS'
    # combinations): fla's three flags with the softplus gate, with and without grouped value
    # heads; the norm alone
    for prep in (
        InputPrep(True, True, None, True, False),
        InputPrep(True, True, None, True, True),
        InputPrep(qk_l2norm=True),
    ):
        makers.append(lambda prep=prep: sm90.chunk_operands_artifact(scale, 1, False, False, prep))
    # the gate-bound forward preparing them (the safe gate's route): fla's three
    # flags, with and without grouped value heads; the norm alone
    for prep in (
        InputPrep(True, True, -5.0, True, False),
        InputPrep(True, True, -5.0, True, True),
        InputPrep(qk_l2norm=True),
    ):
        makers.append(lambda prep=prep: sm90.forward_artifact(2, scale, prep))
    makers += [
        sm90.chunk_outputs_artifact,
        sm90.dense_bwd_artifact,
        # the training step's, on the bf16 chunk states (BF16_STATES)
        lambda: sm90.chunk_outputs_artifact(True),
        lambda: sm90.dense_bwd_artifact(True),
        lambda: sm90.tokens_bwd_artifact(scale),
        lambda: sm90.decayed_tokens_bwd_artifact(scale),
        lambda: sm90.state_cotangent_artifact(0),
        lambda: sm90.decode_artifact(scale, False),
        lambda: sm90.decode_artifact(scale, True),
    ]
    for v_slice in SCAN_TC_V_SLICES:
        makers += [
            lambda v=v_slice: sm90.state_scan_artifact(False, v, True, 1),
            lambda v=v_slice: sm90.state_scan_artifact(True, v, True, 1),
            lambda v=v_slice: sm90.state_scans_artifact(v),
            lambda v=v_slice: sm90.state_cotangent_artifact(v),
            # the forward scans on the chunk core's bf16 U, alone and with the outputs on a
            # warpgroup of their own (stored states or none), and both scans on it
            lambda v=v_slice: sm90.state_scan_artifact(False, v, True, 1, True),
            lambda v=v_slice: sm90.state_scan_outputs_artifact(v, True, True),
            lambda v=v_slice: sm90.state_scan_outputs_artifact(v, False, True),
            lambda v=v_slice: sm90.state_scans_artifact(v, True),
            # the training step's: the chunk states stored in bf16 (BF16_STATES), the reverse
            # scan's addend written and read in bf16 (BF16_ADDEND)
            lambda v=v_slice: sm90.state_scan_artifact(False, v, True, 1, True, True),
            lambda v=v_slice: sm90.state_scan_outputs_artifact(v, True, True, False, True),
            lambda v=v_slice: sm90.state_scan_artifact(True, v, True, 1, False, False, True),
            # the reverse scan in prefill's state layout, as state_scan_kernel runs it at one
            # pass: on the bf16 addend (the training backward's) and on a float32 one (the [K,
            # V] ones above stay exports of their own, which their GPU tests take directly)
            lambda v=v_slice: sm90.state_scan_artifact(True, v, True, 1, False, False, True, True),
            lambda v=v_slice: sm90.state_scan_artifact(True, v, True, 1, False, False, False, True),
            lambda v=v_slice: sm90.state_cotangent_artifact(v, True),
            lambda v=v_slice: sm90.state_scans_artifact(v, True, True, True),
        ]
    return makers


def _worker(dump_dir: str, out: str):
    """In the child: compile every default artifact, pairing each with the PTX file its compile
    left in dump_dir, and write {prefix: fingerprint} to `out`."""
    found = {}
    for make in default_artifacts():
        for name in os.listdir(dump_dir):  # variants of one kernel class share file names
            os.remove(os.path.join(dump_dir, name))
        artifact = make()
        ptx = sorted(f for f in os.listdir(dump_dir) if f.endswith(".ptx"))
        if len(ptx) != 1:
            raise RuntimeError(f"{artifact.prefix}: expected one new PTX file, found {ptx}")
        text = Path(dump_dir, ptx[0]).read_bytes()
        found[artifact.prefix] = {
            "ptx_sha256": hashlib.sha256(text).hexdigest()[:16],
            **cubin_facts(artifact.object_bytes),
        }
    Path(out).write_text(json.dumps(found))


def fingerprints() -> dict:
    """Every default kernel's fingerprint, compiled afresh in a child process."""
    with tempfile.TemporaryDirectory() as tmp:
        dump, cache, out = Path(tmp, "dump"), Path(tmp, "cache"), Path(tmp, "out.json")
        dump.mkdir()
        env = {
            **os.environ,
            "CUTE_DSL_ARCH": "sm_90a",
            "CUTE_DSL_KEEP": "ptx",
            "CUTE_DSL_DUMP_DIR": str(dump),
            "JAX_KDA_CACHE_DIR": str(cache),
            "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        command = [sys.executable, "-m", "benchmarks.kernel_fingerprints", "--worker"]
        subprocess.run([*command, str(dump), str(out)], env=env, cwd=_ROOT, check=True)
        kernels = json.loads(out.read_text())
    return {"nvidia-cutlass-dsl": metadata.version("nvidia-cutlass-dsl"), "kernels": kernels}


def compare(saved: dict, current: dict) -> list[str]:
    """The kernels that moved (or that only one side has), as lines to print: a kernel stays
    what it was when its PTX or its cubin is the same (ptxas may vary the one; a change in the
    DSL's naming may vary the other and leave the binary as it was)."""
    if saved["nvidia-cutlass-dsl"] != current["nvidia-cutlass-dsl"]:
        raise ValueError(
            f"fingerprints from nvidia-cutlass-dsl {saved['nvidia-cutlass-dsl']} cannot be "
            f"compared with {current['nvidia-cutlass-dsl']}'s"
        )
    lines = []
    for name in sorted(set(saved["kernels"]) | set(current["kernels"])):
        before, after = saved["kernels"].get(name), current["kernels"].get(name)
        same = (
            before is not None
            and after is not None
            and any(before[key] == after[key] for key in ("ptx_sha256", "cubin_sha256"))
        )
        if not same:
            lines.append(f"{name}: {before} -> {after}")
    return lines


def _main():
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3])
        return
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
