"""Build the FFI handler (ffi/cute_call.cc, shipped in the package as sm90/cute_call.cc) into a
shared library on demand (needs g++, jax and the CuTe DSL wheel).

The library links libcute_dsl_runtime.so from the installed DSL wheel with an rpath to it, so it
must be built on the machine that runs it (it is cheap: about 2 s). Builds are cached under
`aot.cache_dir()`, keyed by the source, the compiler flags and the two header/library locations.

    python -m jax_kda.sm90.ffi_build      # prints the path of the built library
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

from jax_kda.sm90.export import cache_dir

SOURCE = Path(__file__).resolve().parent / "cute_call.cc"
"""The handler's source: a link to ffi/cute_call.cc in a checkout, a copy of it in an installed
package (pyproject.toml's package data)."""
CXXFLAGS = ["-std=c++17", "-O2", "-fPIC", "-shared", "-Wall"]


def cute_runtime_dir() -> Path:
    """Folder holding CuteDSLRuntime.h (../include) and libcute_dsl_runtime.so, for the DSL flavor
    (cu12/cu13) the DSL picked for this machine's driver."""
    from cutlass.cute.runtime import find_runtime_libraries

    for lib in find_runtime_libraries(enable_tvm_ffi=False):
        if lib.endswith("libcute_dsl_runtime.so"):
            return Path(lib).parent
    raise FileNotFoundError("libcute_dsl_runtime.so not found: is nvidia-cutlass-dsl installed?")


def build_library() -> Path:
    """Path of the built handler library, compiling it if this configuration is new."""
    if not SOURCE.exists():
        raise FileNotFoundError(
            f"{SOURCE} is missing: the sm90 backend builds its FFI handler from it; reinstall "
            "jax_kda (`pip install .` ships it as package data)"
        )
    lib_dir = cute_runtime_dir()
    include_dirs = [Path(jax.ffi.include_dir()), lib_dir.parent / "include"]
    digest = hashlib.sha256()
    for part in [
        SOURCE.read_bytes(),
        *map(str.encode, CXXFLAGS + list(map(str, include_dirs))),
        str(lib_dir).encode(),
        jax.__version__.encode(),
    ]:
        digest.update(hashlib.sha256(part).digest())
    out = cache_dir() / f"libcute_call-{digest.hexdigest()[:16]}.so"
    if out.exists():
        return out
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise FileNotFoundError(f"C++ compiler {cxx!r} not found; set $CXX")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [
            cxx,
            *CXXFLAGS,
            *(f"-isystem{d}" for d in include_dirs),
            str(SOURCE),
            "-o",
            str(tmp_out),
            f"-L{lib_dir}",
            "-l:libcute_dsl_runtime.so",
            f"-Wl,-rpath,{lib_dir}",
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{' '.join(cmd)}\n{result.stderr}")
        os.replace(tmp_out, out)  # atomic: concurrent builders never see a partial library
    return out


if __name__ == "__main__":
    print(build_library())
