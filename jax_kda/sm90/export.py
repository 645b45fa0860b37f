"""Ahead-of-time CuTe DSL compile + export, cached on disk.

A `@cute.jit` launcher is compiled once against fake compact row-major tensors whose outer dims
may be symbolic (`cute.sym_int32()`), exported with `export_to_c`, and stored as an `Artifact`:
the ELF object (host launcher + embedded cubin), the generated C header, the exported symbol
prefix and, per tensor argument, the slice of the C ABI the FFI handler must fill in.

The C ABI of an exported function (read from the generated header; `_check_header` checks every
export against it):
    args[i] = &struct{ void *data; intS dynamic_shapes[k]; intW dynamic_strides[m]; }  per tensor
    args[n] = &stream       (a cudaStream_t value)
    args[n+1] = &ret        (int32 written by the launcher: the CUDA error code, 0 on success)
Dynamic entries appear in mode order; S is 32 unless the dims are `sym_int64`, W is 64 unless
the tensor was made with `use_32bit_stride=True`.

Nothing here needs a GPU: with `CUTE_DSL_ARCH=sm_90a` the DSL compiles for Hopper on any host.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# The DSL silently targets sm_100a when it cannot see a GPU, and crashes on an empty value.
if not os.environ.get("CUTE_DSL_ARCH"):
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"

import cutlass
import cutlass.cute as cute
from cutlass.cute.typing import SymInt

from jax_kda import constants

ARCH = os.environ["CUTE_DSL_ARCH"]


def cache_dir() -> Path:
    """Where exported kernels and the built FFI handler live: $JAX_KDA_CACHE_DIR, else
    ~/.cache/jax_kda."""
    default = Path.home() / ".cache" / "jax_kda"
    return Path(os.environ.get("JAX_KDA_CACHE_DIR", default))


@dataclasses.dataclass(frozen=True)
class TensorAbi:
    """How one tensor argument is passed: which dims/strides are runtime values, their widths."""

    rank: int
    dyn_shape_mask: int  # bit i set: dim i is a runtime value
    dyn_stride_mask: int  # bit i set: stride i is a runtime value
    shape_bits: int  # 32 or 64
    stride_bits: int  # 32 or 64

    @classmethod
    def of_fake(cls, name: str, t: Any) -> TensorAbi:
        shape, stride = tuple(t.shape), tuple(t.stride)
        _check_row_major(name, shape, stride)
        widths = {d.width for d in shape if isinstance(d, SymInt)}
        if len(widths) > 1:
            raise ValueError(f"{name}: dynamic dims mix widths {sorted(widths)}")
        return cls(
            rank=len(shape),
            dyn_shape_mask=_mask(t.dynamic_shapes_mask),
            dyn_stride_mask=_mask(t.dynamic_strides_mask),
            shape_bits=widths.pop() if widths else 32,
            stride_bits=32 if t._use_32bit_stride else 64,
        )

    def header_fields(self) -> dict[str, tuple[str, int]]:
        """The struct fields after `void *data` as the generated header spells them."""
        fields = {
            "dynamic_shapes": (f"int{self.shape_bits}_t", self.dyn_shape_mask.bit_count()),
            "dynamic_strides": (f"int{self.stride_bits}_t", self.dyn_stride_mask.bit_count()),
        }
        return {f: v for f, v in fields.items() if v[1]}


@dataclasses.dataclass(frozen=True)
class Artifact:
    """An exported CuTe function: what the FFI handler needs to load and call it."""

    key: str  # disk-cache key: sha256 over (kernel sources, config, DSL version, arch)
    prefix: str  # symbol prefix given to export_to_c; CuteDSLRT_Module_Get_Function looks it up
    object_bytes: bytes
    header: str
    tensors: tuple[TensorAbi, ...]  # in launcher argument order (the stream comes last)
    # each tensor's element type as numpy names it (cute_call checks the buffers against it)
    dtypes: tuple[str, ...] = ()

    @functools.cached_property
    def object_sha256(self) -> str:
        """Content key the handler loads modules by (one load per distinct object per process)."""
        return hashlib.sha256(self.object_bytes).hexdigest()


_NUMPY_NAMES = {"BFloat16": "bfloat16", "Float16": "float16", "Float32": "float32",
                "Float64": "float64", "Int32": "int32", "Int64": "int64", "Uint32": "uint32",
                "Int8": "int8", "Uint8": "uint8"}  # fmt: skip


def element_dtypes(fake_args: dict[str, Any]) -> tuple[str, ...]:
    """The fake tensors' element types as numpy names them (bfloat16, float32, int32, ...)."""
    names = (str(f.element_type) for f in fake_args.values())
    return tuple(_NUMPY_NAMES.get(name, name.lower()) for name in names)


def _mask(bits: Sequence[int]) -> int:
    return sum(1 << i for i, b in enumerate(bits) if b)


def _check_row_major(name: str, shape: tuple, stride: tuple) -> None:
    """The handler derives strides from XLA's row-major buffers; the fake tensor must agree."""
    expected = 1  # row-major stride of dim i; None once it involves a runtime dim
    for i in reversed(range(len(shape))):
        dynamic = isinstance(stride[i], SymInt)
        if dynamic != (expected is None) or (not dynamic and stride[i] != expected):
            raise ValueError(
                f"{name}: stride {stride} is not row-major for shape {shape}; "
                "make it with row_major_fake()"
            )
        if expected is not None and not isinstance(shape[i], SymInt):
            expected *= shape[i]
        else:
            expected = None


def row_major_fake(dtype: Any, shape: Sequence[int | SymInt], align: int = 16) -> Any:
    """Fake compact row-major tensor (JAX's default layout) for cute.compile."""
    rank = len(shape)
    return cute.runtime.make_fake_compact_tensor(
        dtype, tuple(shape), stride_order=tuple(range(rank - 1, -1, -1)), assumed_align=align
    )


def _check_header(
    header: str, prefix: str, names: Sequence[str], tensors: Sequence[TensorAbi]
) -> None:
    """Read the generated header back and fail if it disagrees with the ABI the handler assumes."""
    wrapper = re.search(r"void \*args\[\d+\] = \{(.*?)\};", header, re.S)
    packed = [a.strip() for a in wrapper[1].split(",")] if wrapper else None
    expected = [*names, "&stream", "&ret"]
    if packed != expected:
        raise RuntimeError(f"exported wrapper packs {packed}; expected {expected}")
    for name, t in zip(names, tensors, strict=True):
        m = re.search(
            r"typedef struct \{\s*void \*data;([^}]*)\}\s*"
            + re.escape(f"{prefix}_Tensor_{name}_t;"),
            header,
        )
        found = {
            f: (c, int(n))
            for c, f, n in re.findall(r"(int\d+_t) (dynamic_\w+)\[(\d+)\];", m[1] if m else "")
        }
        if m is None or found != t.header_fields():
            raise RuntimeError(
                f"tensor {name}: header struct has {found}, expected {t.header_fields()}"
            )


KERNELS_DIR = Path(__file__).resolve().parent / "kernels"


def kernel_sources() -> list[Path]:
    """Every source an exported object can depend on: the kernels package (kernels, shared
    helpers, layout facts) and the constants they import. tests/test_sm90_lowering.py checks
    that the kernels import nothing else of jax_kda."""
    return [*sorted(KERNELS_DIR.glob("*.py")), Path(constants.__file__).resolve()]


def artifact_key(config: dict) -> str:
    """Hash of everything the object depends on: every kernel source (kernel_sources), config,
    DSL version, arch. A changed constant or helper never reuses a stale object."""
    sources = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in kernel_sources()}
    blob = json.dumps(
        {"config": config, "dsl": cutlass.__version__, "arch": ARCH, "sources": sources},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


COMPILE_COUNT = 0  # number of cute.compile calls in this process (tests watch it)


def export(launcher: Callable, fake_args: dict[str, Any], *, prefix: str, config: dict) -> Artifact:
    """Compile `launcher(*fake_args.values(), stream)` for ARCH, or load it from the disk cache.

    `fake_args` maps the launcher's tensor parameter names, in order, to fake tensors; the
    launcher's last parameter must be the `cuda.CUstream`.
    """
    global COMPILE_COUNT
    names = list(fake_args)
    tensors = tuple(TensorAbi.of_fake(n, t) for n, t in fake_args.items())
    abi = {n: dataclasses.asdict(t) for n, t in zip(names, tensors, strict=True)}
    # Static extents (symbolic ones as None) are compiled in, so they are part of the key too.
    extents = {
        n: [d if isinstance(d, int) else None for d in f.shape] for n, f in fake_args.items()
    }
    key = artifact_key({"config": config, "prefix": prefix, "tensors": abi, "extents": extents})
    entry = cache_dir() / f"{prefix}-{key[:24]}"
    if (entry / "meta.json").exists():
        return Artifact(
            key=key,
            prefix=prefix,
            object_bytes=(entry / "kernel.o").read_bytes(),
            header=(entry / "kernel.h").read_text(),
            tensors=tensors,
            dtypes=element_dtypes(fake_args),
        )
    COMPILE_COUNT += 1
    compiled = cute.compile(launcher, *fake_args.values(), cute.runtime.make_fake_stream())
    with tempfile.TemporaryDirectory() as tmp:
        compiled.export_to_c(tmp, "kernel", prefix)
        obj = Path(tmp, "kernel.o").read_bytes()
        header = Path(tmp, "kernel.h").read_text()
    _check_header(header, prefix, names, tensors)
    entry.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=entry.parent))
    (staging / "kernel.o").write_bytes(obj)
    (staging / "kernel.h").write_text(header)
    (staging / "meta.json").write_text(
        json.dumps({"key": key, "tensors": [dataclasses.asdict(t) for t in tensors]}, indent=1)
    )
    for f in ("kernel.o", "kernel.h", "meta.json"):  # meta.json last: it marks the entry complete
        os.replace(staging / f, entry / f)
    staging.rmdir()
    return Artifact(
        key=key, prefix=prefix, object_bytes=obj, header=header, tensors=tensors,
        dtypes=element_dtypes(fake_args),
    )  # fmt: skip
