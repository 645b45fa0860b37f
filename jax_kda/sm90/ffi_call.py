"""Call exported CuTe DSL functions from jax.jit through one XLA FFI target (ffi/cute_call.cc).

`cute_call(artifact, inputs, results)` emits a `stablehlo.custom_call @jax_kda_cute_call` whose
attributes carry the ELF object, its key and symbol prefix, and the per-buffer ABI; the handler in
ffi/cute_call.cc loads the object once per process (FFI instantiate stage) and launches it on
XLA's stream. Lowering never compiles CuTe code: the artifact is built before tracing.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import jax
import numpy as np

from jax_kda.sm90.export import Artifact

TARGET = "jax_kda_cute_call"
STATE_TYPE = "jax_kda_cute_call_state"


@functools.cache
def register(library: str | None = None) -> None:
    """Register the FFI target (and its state type) for CUDA; builds the handler if needed.

    Lowering alone only needs the target name, so this is optional on machines without a GPU.
    """
    if library is None:
        from jax_kda.sm90.ffi_build import build_library

        library = str(build_library())
    lib = ctypes.CDLL(library)
    type_fns = {"type_id": lib.CuteCallStateTypeId, "type_info": lib.CuteCallStateTypeInfo}
    for fn in type_fns.values():
        fn.restype = ctypes.c_void_p
    jax.ffi.register_ffi_type(
        STATE_TYPE, {k: jax.ffi.pycapsule(fn()) for k, fn in type_fns.items()}, platform="CUDA"
    )
    jax.ffi.register_ffi_target(
        TARGET,
        {
            "instantiate": jax.ffi.pycapsule(lib.CuteCallInstantiate),
            "execute": jax.ffi.pycapsule(lib.CuteCallExecute),
        },
        platform="CUDA",
        api_version=1,
    )


def cute_call(
    artifact: Artifact,
    inputs: Sequence[jax.Array],
    results: Sequence[jax.ShapeDtypeStruct],
    aliases: dict[int, int] | None = None,
) -> list[jax.Array]:
    """Run `artifact` on row-major `inputs`; returns one array per entry of `results`.

    The launcher's tensor parameters are, in order: all inputs, then the results that are not
    aliased. `aliases` maps an input index to a result index: that result is the input's buffer
    (donate it to avoid a copy), e.g. a zero-initialised workspace or a NaN-poisoned output.
    Other results start uninitialised.
    """
    aliases = dict(aliases or {})
    passed = [*inputs, *(r for j, r in enumerate(results) if j not in aliases.values())]
    if len(passed) != len(artifact.tensors):
        raise ValueError(
            f"{artifact.prefix} takes {len(artifact.tensors)} tensors, got "
            f"{len(inputs)} inputs + {len(results)} results ({len(aliases)} aliased)"
        )
    for i, (b, t) in enumerate(zip(passed, artifact.tensors, strict=True)):
        if len(b.shape) != t.rank:
            raise ValueError(
                f"{artifact.prefix}: tensor {i} has shape {b.shape}, "
                f"the kernel expects rank {t.rank}"
            )
        # the kernel reads the buffer as its own element type: another dtype of the same rank
        # would be read as garbage, not converted
        if artifact.dtypes and np.dtype(b.dtype).name != artifact.dtypes[i]:
            raise TypeError(
                f"{artifact.prefix}: tensor {i} has dtype {np.dtype(b.dtype).name}, the kernel "
                f"takes {artifact.dtypes[i]}"
            )

    def field(name: str) -> np.ndarray:
        return np.array([getattr(t, name) for t in artifact.tensors], np.int32)

    call = jax.ffi.ffi_call(
        TARGET,
        list(results),
        has_side_effect=False,
        vmap_method="sequential",  # under jax.vmap: one call per batch element
        input_output_aliases=aliases,
        input_layouts=[None] * len(inputs),  # None = row-major
        output_layouts=[None] * len(results),
    )
    outputs = call(
        *inputs,
        module=artifact.object_bytes,
        key=artifact.object_sha256,
        prefix=artifact.prefix,
        rank=field("rank"),
        dyn_shape_mask=field("dyn_shape_mask"),
        dyn_stride_mask=field("dyn_stride_mask"),
        shape_bits=field("shape_bits"),
        stride_bits=field("stride_bits"),
        aliased_rets=np.int64(sum(1 << j for j in aliases.values())),
    )
    return _varying_like(outputs, inputs)


def _varying_axes(x) -> frozenset:
    """The shard_map mesh axes x varies over (empty outside shard_map): JAX's type of x records
    them as manual_axis_type.varying (jax 0.10 and later) or vma (earlier)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", None) or ())


def _varying_like(outputs, inputs):
    """The custom call's outputs typed as varying over every mesh axis an input varies over.
    Under shard_map with check_vma, XLA's own ops give that type, and an output typed invariant
    made the sm90 backward's pullback (a jax.vjp of XLA ops on these inputs) reject its
    cotangent."""
    axes = frozenset().union(*(_varying_axes(x) for x in inputs))
    if not axes:
        return outputs
    typed = []
    for y in outputs:
        missing = tuple(sorted(axes - _varying_axes(y)))
        if missing:  # jax.lax.pcast since jax 0.8; pvary before
            cast = getattr(jax.lax, "pcast", None)
            y = cast(y, missing, to="varying") if cast else jax.lax.pvary(y, missing)
        typed.append(y)
    return typed
