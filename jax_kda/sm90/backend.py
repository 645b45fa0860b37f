"""The sm90 backend: exports the CuTe DSL kernels and calls them through the XLA FFI target.

The forward kernels are compiled for sm_90a with T and N symbolic, once per (heads, scale), the
backward's state scan once per direction and V-slice width; all are cached on disk (see
export.py), so neither a new T or N nor a new process compiles them again.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda import xla
from jax_kda.constants import GATE_FLOOR, HEAD_DIM, SCAN_CHUNK
from jax_kda.sm90.kernels.layout import (
    BF16_ADDEND,
    BF16_STATES,
    DECODE_CTAS_PER_HEAD,
    SCAN_TC_V_SLICES,
)
from jax_kda.sm90.plan import GRID_YZ_LIMIT, plan_prefill, scan_outputs_v_slice, scan_v_slice

SM_COUNT_ENV = "JAX_KDA_SM_COUNT"
"""Without a GPU present, the SM count to plan segments for (e.g. 132 for an H100 SXM or H200)."""

ASSUME_SM90_ENV = "JAX_KDA_ASSUME_SM90"
"""Set to 1 to lower the sm90 path without a Hopper GPU present (cross-lowering, export, CI)."""


def _default_device():
    """The device jit places work on: jax.default_device's when set, else the first device."""
    device = jax.config.jax_default_device
    if isinstance(device, str):  # a platform name
        device = jax.devices(device)[0]
    return device if device is not None else jax.devices()[0]


def has_hopper() -> bool:
    """True when JAX's default device is an NVIDIA Hopper (compute capability 9.0) GPU."""
    device = _default_device()
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def device_sm_count() -> int | None:
    """SMs of JAX's default GPU, read from the device; $JAX_KDA_SM_COUNT when none is present;
    None when neither is known (the plan then splits no sequence)."""
    if has_hopper():
        device = _default_device()
        count = getattr(device, "core_count", None)
        if count:
            return int(count)
        from cuda.bindings import runtime

        attribute = runtime.cudaDeviceAttr.cudaDevAttrMultiProcessorCount
        error, count = runtime.cudaDeviceGetAttribute(attribute, device.local_hardware_id)
        if error != runtime.cudaError_t.cudaSuccess:
            raise RuntimeError(f"reading the SM count of {device}: {error}")
        return int(count)
    value = os.environ.get(SM_COUNT_ENV)
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"${SM_COUNT_ENV}: got {value!r}, expected a positive integer (SMs)")
    return int(value)


INDEX_LIMIT = 2**31
"""The kernels are compiled with 32-bit sizes: no tensor of a call may hold this many elements."""


def scan_unavailable_reason(total_tokens, num_heads, num_sequences) -> str | None:
    """Why the state-scan kernels (the sm90 backward, and the forward without a gate bound)
    cannot take this call's chunk states (32-bit indexing), or None."""
    plan = plan_prefill(total_tokens, num_heads, num_sequences, device_sm_count())
    too_big = {b.name: math.prod(b.shape) for b in plan.backward_buffers}
    too_big = {name: size for name, size in too_big.items() if size >= INDEX_LIMIT}
    if too_big:
        return (
            f"T={total_tokens}, H={num_heads}, N={num_sequences} needs {too_big} elements of "
            f"chunk states, beyond the state-scan kernel's 32-bit indexing (< {INDEX_LIMIT}); "
            "split the call"
        )
    return None


def _device_reason() -> str | None:
    """Why JAX's default device is not one the kernels lower for (None: a Hopper GPU, or
    ASSUME_SM90_ENV set)."""
    if has_hopper() or os.environ.get(ASSUME_SM90_ENV) == "1":
        return None
    device = _default_device()
    return (
        f"JAX's default device is {device.device_kind} ({device.platform}), not a Hopper "
        f"(sm90) GPU; set {ASSUME_SM90_ENV}=1 to lower for Hopper from this machine anyway"
    )


def _toolchain_reason() -> str | None:
    """Why the kernels cannot be built or called here (the DSL, on a Hopper the FFI handler),
    or None."""
    try:
        import cutlass  # noqa: F401
    except ImportError as error:
        return f"nvidia-cutlass-dsl cannot be imported: {error}"
    if has_hopper():
        from jax_kda.sm90.ffi_call import register

        try:
            register()
        except (OSError, RuntimeError) as error:
            return f"the FFI handler (ffi/cute_call.cc) could not be built or loaded: {error}"
    return None


def unavailable_reason(q_dtype, total_tokens, num_heads, num_sequences) -> str | None:
    """Why the sm90 kernels cannot serve this call here, or None if they can."""
    if jnp.dtype(q_dtype) != jnp.bfloat16:
        return f"the sm90 kernels take bfloat16 q, k, v; got {jnp.dtype(q_dtype)}"
    if (reason := _device_reason()) is not None:
        return reason
    symbolic = [
        f"{name}={value}"
        for name, value in (("T", total_tokens), ("H", num_heads), ("N", num_sequences))
        if not isinstance(value, (int, np.integer))
    ]
    if symbolic:
        verb = "is" if len(symbolic) == 1 else "are"
        return (
            f"{', '.join(symbolic)} {verb} symbolic (jax.export with a symbolic shape); the "
            "kernels plan their launch from concrete sizes: export with backend='xla', or with "
            "concrete T, H and N"
        )
    plan = plan_prefill(total_tokens, num_heads, num_sequences, device_sm_count())
    sizes = {
        "q": total_tokens * num_heads * HEAD_DIM,
        "initial_state": num_sequences * num_heads * HEAD_DIM * HEAD_DIM,
        **{b.name: math.prod(b.shape) for b in plan.workspace},
    }
    too_big = {name: size for name, size in sizes.items() if size >= INDEX_LIMIT}
    if too_big:
        return (
            f"T={total_tokens}, H={num_heads}, N={num_sequences} needs {too_big} elements, "
            f"beyond the kernels' 32-bit indexing (< {INDEX_LIMIT}); split the call"
        )
    if plan.largest_grid_yz > GRID_YZ_LIMIT:
        return (
            f"H={num_heads}, N={num_sequences} ({plan.segment_count} segment(s) a sequence) needs "
            f"a launch grid extent of {plan.largest_grid_yz}, beyond CUDA's {GRID_YZ_LIMIT}; "
            "split the call"
        )
    return _toolchain_reason()


@functools.cache
def forward_artifact(num_heads: int, scale: float, prep=None):
    """The exported forward kernel for H heads and this scale (compiled or read from disk).
    prep (kernels' InputPrep, or None): the inputs prepared in PREP as it loads them (the gate
    only with its lower_bound: the safe gate; forward says what the kernel takes then)."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from jax_kda.sm90.export import export, row_major_fake
    from jax_kda.sm90.kernels.input_prep import InputPrep
    from jax_kda.sm90.kernels.kda_fwd_sm90 import KdaConfig, KdaForwardGateSm90, KdaForwardSm90

    if prep == InputPrep():
        prep = None  # nothing prepared: the plain kernel
    config = KdaConfig(num_heads=num_heads, scale=scale, prep=prep)
    tokens, seqs, seqs_plus_one = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    slots = cute.sym_int32()
    records = plan_prefill(0, num_heads, 1).workspace[0]
    square = (HEAD_DIM, HEAD_DIM)
    token_shape = (tokens, num_heads, HEAD_DIM)
    qk_shape = token_shape
    if prep is not None and prep.grouped_qk:  # q and k with heads of their own
        qk_shape = (tokens, cute.sym_int32(), HEAD_DIM)
    state_shape = (seqs, num_heads, HEAD_DIM, HEAD_DIM)
    fakes = {
        "q": row_major_fake(BFloat16, qk_shape),
        "k": row_major_fake(BFloat16, qk_shape),
        "v": row_major_fake(BFloat16, token_shape),
        "g": row_major_fake(Float32, token_shape),
        "beta": row_major_fake(Float32, (tokens, num_heads), align=4),
        "cu_seqlens": row_major_fake(Int32, (seqs_plus_one,), align=4),
    }
    if prep is not None and prep.gate:
        fakes["a_log"] = row_major_fake(Float32, (num_heads,), align=4)
        fakes["dt_bias"] = row_major_fake(Float32, (num_heads, HEAD_DIM))
    fakes |= {
        "initial_state": row_major_fake(Float32, state_shape),
        "o": row_major_fake(BFloat16, token_shape),
        "final_state": row_major_fake(Float32, state_shape),
        "ws_rec": row_major_fake(Int32, (slots, *records.shape[1:])),
        # [segments, N, H, 128, 128] when a sequence is split, else one minimal slot: every
        # outer dim is symbolic so both sizes run the same compiled code.
        "seg_states": row_major_fake(Float32, (*(cute.sym_int32() for _ in range(3)), *square)),
        "seg_ops": row_major_fake(Float32, (*(cute.sym_int32() for _ in range(3)), *square)),
    }
    scale_tag = hashlib.sha256(repr(scale).encode()).hexdigest()[:8]
    settings = {"num_heads": num_heads, "scale": repr(scale), "stages": config.stages}
    suffix = ""
    if prep is not None:
        settings["prep"] = repr(prep)
        suffix = "_prep" + "".join(
            tag for tag, on in (("n", prep.qk_l2norm), ("l", prep.gate),
                                ("b", prep.beta_logits), ("gv", prep.grouped_qk)) if on
        )  # fmt: skip
    launcher = KdaForwardGateSm90 if prep is not None and prep.gate else KdaForwardSm90
    return export(
        launcher(config),
        fakes,
        prefix=f"kda_fwd_sm90_h{num_heads}{suffix}_{scale_tag}",
        config=settings,
    )


def result_shapes(
    total_tokens, num_heads, num_sequences, segments=None
) -> list[jax.ShapeDtypeStruct]:
    """The custom call's results: o [T, H, 128] bf16, final_state [N, H, 128, 128] f32, then the
    plan's workspace buffers (for `segments` segments when given, else the device's plan)."""
    plan = plan_prefill(
        total_tokens, num_heads, num_sequences, device_sm_count(), segments=segments
    )
    return [
        jax.ShapeDtypeStruct((total_tokens, num_heads, HEAD_DIM), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_sequences, num_heads, HEAD_DIM, HEAD_DIM), jnp.float32),
        *(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in plan.workspace),
    ]


def forward(
    q, k, v, g, beta, cu_seqlens, initial_state, scale, *, segments=None, prep=None, a_log=None,
    dt_bias=None,
):  # fmt: skip
    """KDA forward on the sm90 kernels; same contract as xla.forward (q, k, v bfloat16).
    segments: cut every sequence into this many segments (diagnostics, tests); None: the plan's.
    prep (the kernels' InputPrep): the inputs prepared in PREP as it loads them, as
    chunk_core_kernel takes them (q and k with H heads against v's HV = G H where
    prep.grouped_qk, raw where prep.qk_l2norm; g the raw gate projection where prep.gate, which
    here needs prep.lower_bound, with a_log [HV] and dt_bias [HV, 128] or [HV * 128], None for
    fla's defaults; beta logits where prep.beta_logits)."""
    from jax_kda.sm90.ffi_call import cute_call
    from jax_kda.sm90.kernels.input_prep import InputPrep

    prep = InputPrep() if prep is None else prep
    total_tokens, num_heads = v.shape[:2]
    _check_prepared_heads(q, k, num_heads, prep, a_log, dt_bias)
    if prep.gate and prep.lower_bound is None:
        raise ValueError(
            "forward: the gate-bound kernels take the in-kernel gate with its lower_bound only "
            "(the softplus gate has no bound: prepared_forward runs it)"
        )
    results = result_shapes(total_tokens, num_heads, cu_seqlens.shape[0] - 1, segments)
    f32 = jnp.float32  # the raw gate projection and beta logits may come in another dtype
    inputs = [q, k, v, g.astype(f32), beta.astype(f32), jnp.asarray(cu_seqlens, jnp.int32)]
    if prep.gate:
        inputs += _gate_parameters(num_heads, a_log, dt_bias)
    inputs.append(initial_state)
    artifact = forward_artifact(num_heads, scale, prep)
    o, final_state, *_workspace = cute_call(artifact, inputs, results)
    return o, final_state


def _gate_parameters(heads, a_log, dt_bias):
    """The in-kernel gate's a_log [HV] and dt_bias [HV, 128] as the kernels take them, float32
    (None: zeros, fla's defaults of amplitude 1 and no bias)."""
    f32 = jnp.float32
    a_log = jnp.zeros((heads,), f32) if a_log is None else a_log.astype(f32)
    dt_bias = jnp.zeros((heads, HEAD_DIM), f32) if dt_bias is None else dt_bias
    return [a_log, dt_bias.astype(f32).reshape(heads, HEAD_DIM)]


def _check_prepared_heads(q, k, heads, prep, a_log, dt_bias):
    """The heads of q and k against v's (the same, or a divisor where prep.grouped_qk) and the
    in-kernel gate's parameters' shapes, as the kernels with in-kernel prep take them."""
    grouped = prep.grouped_qk
    if q.shape != k.shape or q.shape[1] == 0 or (
        heads % q.shape[1] if grouped else q.shape[1] != heads
    ):  # fmt: skip
        raise ValueError(
            f"q, k: got heads {q.shape[1]}, {k.shape[1]} against v's {heads}; expected "
            + ("a divisor of it, the same for both" if grouped else "the same")
        )
    if not prep.gate and (a_log is not None or dt_bias is not None):
        raise ValueError("a_log and dt_bias go with an in-kernel gate (prep.gate)")
    if a_log is not None and tuple(a_log.shape) != (heads,):
        raise ValueError(f"a_log: got shape {tuple(a_log.shape)}, expected ({heads},)")
    if dt_bias is not None and tuple(dt_bias.shape) not in ((heads, HEAD_DIM), (heads * HEAD_DIM,)):
        raise ValueError(
            f"dt_bias: got shape {tuple(dt_bias.shape)}, expected ({heads}, {HEAD_DIM}) or "
            f"({heads * HEAD_DIM},)"
        )


@functools.cache
def state_scan_artifact(
    reverse: bool, v_slice: int, tensor_cores: bool = False, passes: int = 3,
    plain_addend: bool = False, bf16_states: bool = False, bf16_addend: bool = False,
    state_vk: bool = False,
):  # fmt: skip
    """The exported state-scan kernel for one direction and V-slice width: the SIMT kernel
    (kernels/kda_state_scan_sm90.py; v_slice 64 the m64 wgmma one), or with tensor_cores the
    one with the slice as wgmma N (kernels/kda_state_scan_tc_sm90.py, bf16 [hi | lo] operand
    images from state_scan_operands; passes=1: one bf16 product each, images of the values
    alone). plain_addend (forward, tensor cores): the addend U as the chunk core stores it,
    bf16 [slots, H, 64 * 128], each CTA bringing its slice by TMA, and y0 and final in
    prefill's layout [N, H, V, K] (the others': [N, H, K, V]). bf16_states (forward, tensor
    cores): the chunk states stored in bf16 (BF16_STATES); bf16_addend (reverse, tensor cores):
    the addend slices read in bf16 (BF16_ADDEND); state_vk (reverse, tensor cores): y0 and
    final in prefill's layout too. Slots, heads and sequences are all symbolic: one compile
    serves every call."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from jax_kda.sm90.export import export, row_major_fake
    from jax_kda.sm90.kernels.kda_state_scan_sm90 import ChunkStateScanSm90, ScanConfig
    from jax_kda.sm90.kernels.kda_state_scan_tc_sm90 import ChunkStateScanTcSm90, image_elems
    from jax_kda.sm90.kernels.kda_state_scan_wgmma_sm90 import ChunkStateScanWgmmaSm90
    from jax_kda.sm90.kernels.layout import SCAN_WGMMA_V_SLICE

    config = ScanConfig(reverse=reverse, v_slice=v_slice)
    slots, heads, seqs = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    chunk_shape = (slots, heads, SCAN_CHUNK, HEAD_DIM)
    square = (HEAD_DIM, HEAD_DIM)
    if plain_addend and (reverse or not tensor_cores):
        raise ValueError("only the forward tensor-core scan takes its addend plain")
    if passes != 3 and not tensor_cores:
        raise ValueError("only the tensor-core state scan has a single-pass variant")
    if bf16_states and (reverse or not tensor_cores):
        raise ValueError("only the forward tensor-core scan stores its chunk states in bf16")
    if bf16_addend and (not reverse or not tensor_cores):
        raise ValueError("only the reverse tensor-core scan reads its addend in bf16")
    if state_vk and (not reverse or not tensor_cores):
        raise ValueError(
            f"state_vk=True needs reverse=True and tensor_cores=True, got reverse={reverse}, "
            f"tensor_cores={tensor_cores} (the plain forward scan takes prefill's layout anyway)"
        )
    if tensor_cores:
        kernel = ChunkStateScanTcSm90(config, passes, plain_addend=plain_addend, state_vk=state_vk)
        image = (slots, heads, image_elems(passes))
        operands = {
            "a_img": row_major_fake(BFloat16, image),
            "bt_img": row_major_fake(BFloat16, image),
        }
        addend = (slots, heads, HEAD_DIM // v_slice, config.addend_rows * v_slice)
    else:
        wgmma = v_slice == SCAN_WGMMA_V_SLICE
        kernel = (ChunkStateScanWgmmaSm90 if wgmma else ChunkStateScanSm90)(config)
        operands = {
            "a_op": row_major_fake(Float32, chunk_shape),
            "b_op": row_major_fake(Float32, chunk_shape),
        }
        addend = (slots, heads, config.addend_rows, HEAD_DIM)
    if plain_addend:  # U as the chunk core stores it
        add_type, addend = BFloat16, (slots, heads, SCAN_CHUNK * HEAD_DIM)
    else:
        add_type = BFloat16 if bf16_addend else Float32
    fakes = {
        **operands,
        "decay": row_major_fake(Float32, (slots, heads, HEAD_DIM)),
        "addend": row_major_fake(add_type, addend),
        "cu_seqlens": row_major_fake(Int32, (cute.sym_int32(),), align=4),
        "y0": row_major_fake(Float32, (seqs, heads, *square)),
        "states": row_major_fake(BFloat16 if bf16_states else Float32, (slots, heads, *square)),
        "final": row_major_fake(Float32, (seqs, heads, *square)),
    }
    direction = "rev" if reverse else "fwd"
    kind = "t" if tensor_cores else "v"
    config = {"reverse": reverse, "v_slice": v_slice, "tensor_cores": tensor_cores}
    suffix = ""
    if passes != 3:
        config["passes"] = passes
        suffix = f"x{passes}"
    if plain_addend:
        config["plain_addend"] = True
        suffix += "u"
    if bf16_states or bf16_addend:
        config["bf16_states" if bf16_states else "bf16_addend"] = True
        suffix += "h"
    if state_vk:
        config["state_vk"] = True
        suffix += "k"
    return export(
        kernel, fakes, prefix=f"kda_state_scan_sm90_{direction}_{kind}{v_slice}{suffix}",
        config=config,
    )  # fmt: skip


@functools.cache
def state_scan_outputs_artifact(
    v_slice: int, states: bool = True, outputs_warpgroup: bool = False, images: bool = False,
    bf16_states: bool = False,
):  # fmt: skip
    """The exported forward tensor-core scan at one bf16 pass that writes every chunk's outputs
    as well (kernels/kda_state_scan_tc_sm90.py, ChunkStateScanOutputsTcSm90; states=False:
    ChunkOutputsScanTcSm90, no chunk states stored; outputs_warpgroup: the O products and
    stores on a second warpgroup, off the serial chain; images (with outputs_warpgroup): qg
    and attn come as the chunk core's images variant writes them):
    tokens, slots, heads and sequences symbolic. images needs states=False: only a call that
    is not differentiated takes them. bf16_states: the chunk states stored in bf16
    (BF16_STATES)."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from jax_kda.sm90.export import export, row_major_fake
    from jax_kda.sm90.kernels.kda_state_scan_tc_sm90 import (
        ChunkOutputsScanTcSm90,
        ChunkStateScanOutputsTcSm90,
        image_elems,
    )

    if v_slice not in SCAN_TC_V_SLICES:
        raise ValueError(
            f"the scan with outputs runs on tensor cores: v_slice in {SCAN_TC_V_SLICES}"
        )
    tokens, slots, heads, seqs = (cute.sym_int32() for _ in range(4))
    image = (slots, heads, image_elems(1))
    square = (HEAD_DIM, HEAD_DIM)
    fakes = {
        "a_img": row_major_fake(BFloat16, image),
        "bt_img": row_major_fake(BFloat16, image),
        "decay": row_major_fake(Float32, (slots, heads, HEAD_DIM)),
        "addend": row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK * HEAD_DIM)),  # U, plain
        "cu_seqlens": row_major_fake(Int32, (cute.sym_int32(),), align=4),
        "y0": row_major_fake(Float32, (seqs, heads, *square)),
        "qg": row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK * HEAD_DIM)),
        "attn": row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK * SCAN_CHUNK)),
        "states": row_major_fake(BFloat16 if bf16_states else Float32, (slots, heads, *square)),
        "final": row_major_fake(Float32, (seqs, heads, *square)),
        "o": row_major_fake(BFloat16, (tokens, heads, HEAD_DIM)),
    }
    if bf16_states and not states:
        raise ValueError("bf16_states: a scan that stores no chunk states")
    if not states:
        del fakes["states"]
    if images and (states or not outputs_warpgroup):
        raise ValueError(
            "images=True is a variant of the scan with outputs_warpgroup=True that stores no "
            "chunk states (the forward of a call that is not differentiated)"
        )
    if states:
        kernel = ChunkStateScanOutputsTcSm90(
            v_slice, outputs_warpgroup=outputs_warpgroup, outputs_images=images
        )
    else:
        kernel = ChunkOutputsScanTcSm90(
            v_slice, outputs_warpgroup=outputs_warpgroup, outputs_images=images
        )
    config = {"v_slice": v_slice, "states": states}
    if outputs_warpgroup:
        config["outputs_warpgroup"] = True
    if images:
        config["images"] = True
    if bf16_states:
        config["bf16_states"] = True
    suffix = ("" if states else "f") + ("w" if outputs_warpgroup else "") + ("i" if images else "")
    suffix += "h" if bf16_states else ""
    return export(
        kernel, fakes, prefix=f"kda_state_scan_sm90_fwd_t{v_slice}x1o{suffix}", config=config,
    )  # fmt: skip


def _scan_outputs_plan(
    num_heads, num_sequences, num_slots, tokens, v_slice, tensor_cores, passes, fuse
):  # fmt: skip
    """(one launch?, v_slice, tensor_cores) of state_scan_outputs_kernel's call on a bf16 U:
    fuse None decides where each scan CTA has an SM of its own (plan.scan_outputs_v_slice's
    width unless v_slice is given); the one launch needs the tensor-core scan at one pass and
    some tokens."""
    if fuse is None:
        sm_count = device_sm_count()
        if v_slice is None:
            v_slice = scan_outputs_v_slice(num_heads, num_sequences, sm_count)
            fuse = v_slice is not None
        else:  # the given width: where its CTAs have an SM each
            ctas = (HEAD_DIM // v_slice) * num_heads * num_sequences
            fuse = sm_count is not None and ctas <= sm_count
    v_slice, tensor_cores = scan_variant(num_heads, num_sequences, v_slice, tensor_cores)
    empty = num_slots == 0 or tokens == 0  # the outputs kernel's zeros, no launch
    one = bool(fuse and tensor_cores and passes in (None, 1) and not empty)
    return one, v_slice, tensor_cores


def scan_outputs_fused(
    num_heads, num_sequences, num_slots, tokens, *, v_slice=None, tensor_cores=None,
    passes=None, fuse=None,
):  # fmt: skip
    """Whether state_scan_outputs_kernel, called with these switches on a bf16 U (the chunk
    core's), runs the one launch (so that the chunk core may write Qg and Aqk as its images
    for it) rather than the two kernels."""
    return _scan_outputs_plan(
        num_heads, num_sequences, num_slots, tokens, v_slice, tensor_cores, passes, fuse
    )[0]


def state_scan_outputs_kernel(
    w_op, kd_op, decay, u, cu_seqlens, y0, qg, attn, rows, *, v_slice=None, tensor_cores=None,
    passes=None, fuse=None, states=True, outputs_warpgroup=False, plain_addend=False,
    images=False, bf16_states=False,
):  # fmt: skip
    """The forward state scan and every chunk's outputs after it: (states, final, o) =
    state_scan_kernel(w, kd, decay, u, cu_seqlens, y0) and chunk_outputs_kernel(states, w, u,
    qg, attn, cu_seqlens, rows), o bfloat16 in the tokens' rows. In one launch
    (ChunkStateScanOutputsTcSm90) where the scan variant (scan_variant's) runs on tensor cores
    at one bf16 pass and `fuse` says so (None: where each scan CTA has an SM of its own, at
    plan.scan_outputs_v_slice's width unless v_slice is given); otherwise the two
    kernels one after the other (also where U is not bfloat16: the one launch takes it plain
    in bf16). states=False: the caller needs no chunk states (a call that is not
    differentiated); the one launch then stores none and returns None for them.
    outputs_warpgroup: the one launch's variant with the O products on a second warpgroup;
    plain_addend: the two kernels' scan takes U as it is (state_scan_kernel's). All three
    passed their GPU tests (H100, 2026-12-06) and are training_forward's defaults.
    images (with outputs_warpgroup, where the one launch runs: scan_outputs_fused): qg and attn
    are the chunk core's images variant's (chunk_core_kernel(images=True)), flat; not yet run
    on a GPU. bf16_states: the chunk states come back in bf16 (BF16_STATES)."""
    from jax_kda.sm90.ffi_call import cute_call

    num_heads, num_sequences = y0.shape[1], y0.shape[0]
    one, v_slice, tensor_cores = _scan_outputs_plan(
        num_heads, num_sequences, qg.shape[0], rows.shape[0], v_slice, tensor_cores, passes, fuse
    )
    plain = _unsliced(u).dtype == jnp.bfloat16  # U as the chunk core gives it (bf16, exact)
    if not one or not plain:
        if images:
            raise ValueError(
                "images=True: qg and attn as images serve the one launch only, which this "
                "call does not run (scan_outputs_fused says when it does)"
            )
        states, final = state_scan_kernel(
            w_op, kd_op, decay, u, cu_seqlens, y0, reverse=False, v_slice=v_slice,
            tensor_cores=tensor_cores, passes=passes, plain_addend=plain_addend,
            bf16_states=bf16_states,  # also where only the outputs kernel reads them
        )  # fmt: skip
        w = w_op.image if isinstance(w_op, ImagedOperand) else w_op
        o = chunk_outputs_kernel(states, w, u, qg, attn, cu_seqlens, rows)
        return states, final, o
    slots, heads = qg.shape[:2]
    a_img, bt_img, _ = state_scan_operands(w_op, kd_op, None, v_slice, 1)  # U goes in plain
    bf16 = jnp.bfloat16
    addend = _unsliced(u).astype(bf16).reshape(slots, heads, -1)
    bf16_states = bool(bf16_states and states)
    results = [
        jax.ShapeDtypeStruct((slots, *y0.shape[1:]), bf16 if bf16_states else jnp.float32),
        jax.ShapeDtypeStruct(y0.shape, jnp.float32),
        jax.ShapeDtypeStruct((rows.shape[0], heads, HEAD_DIM), bf16),
    ]
    # the kernel takes y0 and gives final as [V, K], prefill's layout: these transposes and
    # xla.forward's cancel, so the state is not copied on the way in or out
    inputs = [
        a_img, bt_img, decay, addend, jnp.asarray(cu_seqlens, jnp.int32),
        jnp.swapaxes(y0, -1, -2), qg.astype(bf16).reshape(slots, heads, -1),
        attn.astype(bf16).reshape(slots, heads, -1),
    ]  # fmt: skip
    artifact = state_scan_outputs_artifact(v_slice, states, outputs_warpgroup, images, bf16_states)
    if not states:
        final, o = cute_call(artifact, inputs, results[1:])
        return None, jnp.swapaxes(final, -1, -2), o
    states, final, o = cute_call(artifact, inputs, results)
    return states, jnp.swapaxes(final, -1, -2), o


def reverse_scan_addend_v_slice(num_heads, num_sequences, v_slice=None, tensor_cores=None):
    """The width at which reverse_scan_addend_kernel runs its one launch, or None where it runs
    the state cotangent kernel and the reverse scan instead: where each CTA of the one launch
    (about 163 KiB of shared memory: one an SM) has an SM of its own, at the plan's width for
    the scan with the outputs (plan.scan_outputs_v_slice, the same rule) unless v_slice is
    given; never off tensor cores or with an unknown SM count."""
    sm_count = device_sm_count()
    if tensor_cores is False or sm_count is None:
        return None
    if v_slice is None:
        return scan_outputs_v_slice(num_heads, num_sequences, sm_count)
    fits = (HEAD_DIM // v_slice) * num_heads * num_sequences <= sm_count
    return v_slice if v_slice in SCAN_TC_V_SLICES and fits else None


def reverse_scan_addend_kernel(
    kd_op, w_op, decay, qg, w, attn, d_o, cu_seqlens, rows, d_final, *, v_slice=None,
    tensor_cores=None, passes=None, bf16_addend=False, fuse=True,
):  # fmt: skip
    """(g_end, d_y0): the reverse scan (state_scan_kernel's contract, reverse) on the outputs'
    part of each chunk's state cotangent (state_cotangent_kernel's d_states from qg, w, attn
    and d_o). In one launch (ReverseScanAddendTcSm90: the addend formed on the scan's second
    warpgroup, never stored) where fuse and reverse_scan_addend_v_slice say so and there are
    slots and tokens; otherwise the two kernels (the addend in bf16 where bf16_addend)."""
    from jax_kda.sm90.ffi_call import cute_call

    heads, seqs = d_final.shape[1], d_final.shape[0]
    slots = qg.shape[0]
    one = reverse_scan_addend_v_slice(heads, seqs, v_slice, tensor_cores) if fuse else None
    if one is None or passes not in (None, 1) or slots == 0 or d_o.shape[0] == 0:
        d_states = state_cotangent_kernel(
            qg, w, attn, d_o, cu_seqlens, rows, scan_v_slice=v_slice,
            scan_tensor_cores=tensor_cores, bf16=bf16_addend,
        )  # fmt: skip
        return state_scan_kernel(
            kd_op, w_op, decay, d_states, cu_seqlens, d_final, reverse=True, v_slice=v_slice,
            tensor_cores=tensor_cores, passes=passes,
        )  # fmt: skip
    bf16 = jnp.bfloat16
    kd_img, w_img, _ = state_scan_operands(kd_op, w_op, None, one, 1)
    inputs = [
        kd_img, w_img, decay, qg.astype(bf16).reshape(slots, heads, -1),
        attn.astype(bf16).reshape(slots, heads, -1), d_o.astype(bf16),
        jnp.asarray(cu_seqlens, jnp.int32), d_final.astype(jnp.float32),
    ]  # fmt: skip
    results = [
        jax.ShapeDtypeStruct((slots, *d_final.shape[1:]), jnp.float32),
        jax.ShapeDtypeStruct(d_final.shape, jnp.float32),
    ]
    g_end, d_y0 = cute_call(reverse_scan_addend_artifact(one), inputs, results)
    return g_end, d_y0


@functools.cache
def reverse_scan_addend_artifact(v_slice: int):
    """The exported reverse tensor-core scan that forms its addend itself
    (kernels/kda_state_scan_tc_sm90.py, ReverseScanAddendTcSm90: the state cotangent kernel's
    dL/dS on a second warpgroup); tokens, slots, heads and sequences symbolic."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from jax_kda.sm90.export import export, row_major_fake
    from jax_kda.sm90.kernels.kda_state_scan_tc_sm90 import ReverseScanAddendTcSm90, image_elems

    if v_slice not in SCAN_TC_V_SLICES:
        raise ValueError(f"the reverse scan with its addend runs at v_slice in {SCAN_TC_V_SLICES}")
    tokens, slots, heads, seqs = (cute.sym_int32() for _ in range(4))
    image = (slots, heads, image_elems(1))
    square = (HEAD_DIM, HEAD_DIM)
    fakes = {
        "kd_img": row_major_fake(BFloat16, image),
        "w_img": row_major_fake(BFloat16, image),
        "decay": row_major_fake(Float32, (slots, heads, HEAD_DIM)),
        "qg": row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK * HEAD_DIM)),
        "attn": row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK * SCAN_CHUNK)),
        "d_out": row_major_fake(BFloat16, (tokens, heads, HEAD_DIM)),
        "cu_seqlens": row_major_fake(Int32, (cute.sym_int32(),), align=4),
        "d_final": row_major_fake(Float32, (seqs, heads, *square)),
        "g_end": row_major_fake(Float32, (slots, heads, *square)),
        "d_y0": row_major_fake(Float32, (seqs, heads, *square)),
    }
    return export(
        ReverseScanAddendTcSm90(v_slice), fakes, prefix=f"kda_state_scan_sm90_rev_t{v_slice}x1a",
        config={"v_slice": v_slice, "addend_warpgroup": True},
    )  # fmt: skip


@functools.cache
def state_scans_artifact(
    v_slice: int, plain_addend: bool = False, bf16_states: bool = False, bf16_addend: bool = False
):  # fmt: skip
    """The exported kernel that runs both state scans of the training backward in one launch
    (kernels/kda_state_scans_sm90.py: the single-pass tensor-core scan, forward and reverse
    side by side; at one pass an operand's image is the same in both roles; plain_addend: the
    forward one takes U as the chunk core stores it, bf16 [slots, H, 64 * 128], and y0, final,
    d_final and d_y0 are [N, H, V, K], prefill's layout; bf16_states: the forward's chunk
    states stored in bf16, BF16_STATES; bf16_addend: the reverse's addend slices read in bf16,
    BF16_ADDEND). Slots, heads and sequences are symbolic: one compile serves every call."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from jax_kda.sm90.export import export, row_major_fake
    from jax_kda.sm90.kernels.kda_state_scan_tc_sm90 import image_elems
    from jax_kda.sm90.kernels.kda_state_scans_sm90 import BothStateScansSm90

    if v_slice not in SCAN_TC_V_SLICES:
        raise ValueError(f"both scans run on tensor cores: v_slice in {SCAN_TC_V_SLICES}")
    slots, heads, seqs = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    image = (slots, heads, image_elems(1))
    square = (HEAD_DIM, HEAD_DIM)
    slices = HEAD_DIM // v_slice
    fakes = {
        "w_img": row_major_fake(BFloat16, image),
        "kd_img": row_major_fake(BFloat16, image),
        "decay": row_major_fake(Float32, (slots, heads, HEAD_DIM)),
        "u": (
            row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK * HEAD_DIM))
            if plain_addend
            else row_major_fake(Float32, (slots, heads, slices, SCAN_CHUNK * v_slice))
        ),
        "d_states": row_major_fake(
            BFloat16 if bf16_addend else Float32, (slots, heads, slices, HEAD_DIM * v_slice)
        ),
        "cu_seqlens": row_major_fake(Int32, (cute.sym_int32(),), align=4),
        "y0": row_major_fake(Float32, (seqs, heads, *square)),
        "d_final": row_major_fake(Float32, (seqs, heads, *square)),
        "states": row_major_fake(BFloat16 if bf16_states else Float32, (slots, heads, *square)),
        "final": row_major_fake(Float32, (seqs, heads, *square)),
        "g_end": row_major_fake(Float32, (slots, heads, *square)),
        "d_y0": row_major_fake(Float32, (seqs, heads, *square)),
    }
    config = {"v_slice": v_slice, "passes": 1}
    if plain_addend:
        config["plain_addend"] = True
    suffix = "u" if plain_addend else ""
    for name, on, letter in (("bf16_states", bf16_states, "h"), ("bf16_addend", bf16_addend, "a")):
        if on:
            config[name] = True
            suffix += letter
    return export(
        BothStateScansSm90(v_slice, 1, plain_addend), fakes,
        prefix=f"kda_state_scans_sm90_t{v_slice}x1{suffix}", config=config,
    )  # fmt: skip


def state_scans_kernel(
    w_op, kd_op, decay, u, d_states, cu_seqlens, y0, d_final, *, v_slice=None,
    tensor_cores=None, passes=None, plain_addend=False, bf16_states=False,
):  # fmt: skip
    """Both scans of the training backward: (states, final) = xla.state_scan(w, kd, decay, u,
    cu_seqlens, y0) and (g_end, d_y0) = xla.state_scan(kd, w, decay, d_states, cu_seqlens,
    d_final, reverse=True), in one launch where the variant (scan_variant's) runs on tensor
    cores at one pass (state_scans_artifact), else as two state_scan_kernel calls. The
    operands as state_scan_kernel takes them (ImagedOperand, SlicedAddend); plain_addend as
    there (the forward scan reads a bf16 U as it is; training_forward's default); bf16_states
    and a bf16 SlicedAddend d_states as state_scan_kernel takes them."""
    from jax_kda.sm90.ffi_call import cute_call

    num_heads, num_sequences = y0.shape[1], y0.shape[0]
    v_slice, tensor_cores = scan_variant(num_heads, num_sequences, v_slice, tensor_cores)
    if passes is None:
        passes = 1 if tensor_cores else 3
    if not tensor_cores or passes != 1:
        run = functools.partial(
            state_scan_kernel, v_slice=v_slice, tensor_cores=tensor_cores, passes=passes
        )
        states, final = run(
            w_op, kd_op, decay, u, cu_seqlens, y0, reverse=False, plain_addend=plain_addend,
            bf16_states=bf16_states,
        )  # fmt: skip
        g_end, d_y0 = run(kd_op, w_op, decay, d_states, cu_seqlens, d_final, reverse=True)
        return states, final, g_end, d_y0
    plain_addend = (
        plain_addend and not isinstance(u, SlicedAddend) and u.dtype == jnp.bfloat16
        and u.shape[0] > 0
    )  # fmt: skip
    y0_in, d_final_in = y0, d_final
    if plain_addend:
        w_img, kd_img, _ = state_scan_operands(w_op, kd_op, None, v_slice, 1)
        u_slices = u.reshape(u.shape[0], u.shape[1], SCAN_CHUNK * HEAD_DIM)
        # that variant's y0, final, d_final and d_y0 are [V, K] (prefill's layout): these
        # transposes and xla.forward's (and their cotangents') cancel
        y0_in, d_final_in = jnp.swapaxes(y0, -1, -2), jnp.swapaxes(d_final, -1, -2)
    else:
        w_img, kd_img, u_slices = state_scan_operands(w_op, kd_op, u, v_slice, 1)
    ds_slices = addend_slices(d_states, v_slice)
    bf16_addend = ds_slices.dtype == jnp.bfloat16
    slots = w_img.shape[0]
    results = [
        jax.ShapeDtypeStruct((slots, *y0.shape[1:]), jnp.bfloat16 if bf16_states else jnp.float32),
        jax.ShapeDtypeStruct(y0.shape, jnp.float32),
        jax.ShapeDtypeStruct((slots, *y0.shape[1:]), jnp.float32),
        jax.ShapeDtypeStruct(y0.shape, jnp.float32),
    ]
    inputs = [
        w_img, kd_img, decay, u_slices, ds_slices, jnp.asarray(cu_seqlens, jnp.int32), y0_in,
        d_final_in,
    ]  # fmt: skip
    artifact = state_scans_artifact(v_slice, plain_addend, bf16_states, bf16_addend)
    states, final, g_end, d_y0 = cute_call(artifact, inputs, results)
    if plain_addend:
        final, d_y0 = jnp.swapaxes(final, -1, -2), jnp.swapaxes(d_y0, -1, -2)
    return states, final, g_end, d_y0


def _truncated_split(x):
    """x (float32) = hi + lo with hi = x's top 16 bits (exactly a bfloat16) and lo = x - hi
    rounded to bfloat16: |x - hi - lo| <= 2^-16 |x|. Bit masking, not a rounding convert: XLA
    may drop an f32 -> bf16 -> f32 round trip (excess precision), which would zero lo."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
    hi = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return hi.astype(jnp.bfloat16), (x - hi).astype(jnp.bfloat16)


def _interleaved_image(x):
    """[..., r, c] (row-major, K-major rows of a wgmma operand, or its N-major transpose's) ->
    [..., r * c] in the element order of wgmma.inter_image_layout's image in shared memory:
    8 x 8 core matrices, rows within them, then blocks down the rows, then across."""
    *lead, r, c = x.shape
    n = len(lead)
    x = x.reshape(*lead, r // 8, 8, c // 8, 8)
    x = jnp.transpose(x, (*range(n), n + 2, n, n + 1, n + 3))
    return x.reshape(*lead, r * c)


def _image_rows(image, rows: int = SCAN_CHUNK, cols: int = HEAD_DIM):
    """_interleaved_image's inverse: [..., rows * cols] in the interleaved images' order ->
    [..., rows, cols] float32."""
    *lead, _ = image.shape
    n = len(lead)
    x = image.reshape(*lead, cols // 8, rows // 8, 8, 8)
    x = jnp.transpose(x, (*range(n), n + 1, n + 2, n, n + 3))
    return x.reshape(*lead, rows, cols).astype(jnp.float32)


def chunk_rows(x):
    """A chunk core output as float32 [slots, H, 64, 128] rows: W or Kd from chunk_core_kernel
    (bf16 [slots, H, 64 * 128] in the scan's operand order) unpacked, any other cast."""
    if x.ndim == 3 and x.shape[-1] == SCAN_CHUNK * HEAD_DIM:
        return _image_rows(x)
    return x.astype(jnp.float32)


def chunk_image(x):
    """W or Kd as chunk_core_kernel gives it (bf16 in the scan's operand order), from the
    stand-in's float32 [slots, H, 64, 128] rows where it comes as those."""
    return x if x.ndim == 3 else _interleaved_image(x.astype(jnp.bfloat16))


def state_scan_operands(a_op, b_op, addend, v_slice: int, passes: int = 3):
    """The tensor-core scan's inputs from xla.state_scan's a_op, b_op [slots, H, 64, K] and
    addend [slots, H, rows, V], each as one contiguous block per (slot, head) that a bulk copy
    brings into shared memory as it is: A's image [64 tokens, hi | lo channels] and B^T's
    [channels, hi | lo tokens] (bf16, in the interleaved images' order), and the addend's
    V slices [slots, H, V / v_slice, rows * v_slice] (None for an addend of None). passes=1:
    the images hold the bf16 values alone ([64 tokens, channels] and [channels, tokens])."""
    if passes == 1:
        a_img, bt_img = (
            op.image if isinstance(op, ImagedOperand)
            else _interleaved_image(op.astype(jnp.bfloat16))
            for op in (a_op, b_op)
        )  # fmt: skip
    else:
        a_op, b_op = _values(a_op), _values(b_op)
        a_hi, a_lo = _truncated_split(a_op)
        b_hi, b_lo = _truncated_split(b_op)
        a_img = _interleaved_image(jnp.concatenate([a_hi, a_lo], axis=-1))
        bt_img = _interleaved_image(jnp.concatenate([b_hi, b_lo], axis=-2))
    return a_img, bt_img, None if addend is None else addend_slices(addend, v_slice)


def addend_slices(addend, v_slice: int):
    """A scan addend ([slots, H, rows, V], or SlicedAddend) in the tensor-core scan's V
    slices [slots, H, V / v_slice, rows * v_slice]."""
    if isinstance(addend, SlicedAddend) and addend.v_slice == v_slice:
        return addend.slices
    slots, heads, rows, width = _unsliced(addend).shape
    slices = _unsliced(addend).reshape(slots, heads, rows, width // v_slice, v_slice)
    slices = jnp.transpose(slices, (0, 1, 3, 2, 4)).reshape(slots, heads, -1, rows * v_slice)
    return slices.astype(jnp.float32)


class ImagedOperand(NamedTuple):
    """A state scan's a_op or b_op ([slots, H, 64, 128] float32) with its single-pass
    tensor-core image beside it (chunk_core_kernel's w_img / kd_img): state_scan_operands takes
    the image as it is at one pass, the values elsewhere."""

    values: jax.Array
    image: jax.Array


def _values(op):
    return op.values if isinstance(op, ImagedOperand) else op


class SlicedAddend(NamedTuple):
    """A state scan's addend [slots, H, rows, V] already in the tensor-core scan's order
    (state_scan_operands' slices: [slots, H, V / v_slice, rows * v_slice]), as
    state_cotangent_kernel writes it for the reverse scan. state_scan_kernel takes it as it is
    where its variant has this v_slice, and puts it back into [slots, H, rows, V] elsewhere."""

    slices: jax.Array
    v_slice: int


def _unsliced(addend):
    """[slots, H, rows, V] from an addend as it is or as SlicedAddend."""
    if not isinstance(addend, SlicedAddend):
        return addend
    slots, heads, count, block = addend.slices.shape
    rows = block // addend.v_slice
    x = addend.slices.reshape(slots, heads, count, rows, addend.v_slice)
    return jnp.transpose(x, (0, 1, 3, 2, 4)).reshape(slots, heads, rows, count * addend.v_slice)


def scan_variant(
    num_heads: int, num_sequences: int, v_slice=None, tensor_cores=None, both_directions=False
):  # fmt: skip
    """(v_slice, tensor_cores) of the state scan state_scan_kernel runs for these arguments:
    None takes the plan's width (plan.scan_v_slice, for one direction or with both_directions
    for both in one launch), on tensor cores where that width has a tensor-core kernel (H200,
    2048x12x1, both directions: 95 us at t16 against the SIMT kernel's 287 at v16;
    v_slice=64 is the m64 wgmma one)."""
    if v_slice is None:
        v_slice = scan_v_slice(num_heads, num_sequences, device_sm_count(), both_directions)
    if tensor_cores is None:
        tensor_cores = v_slice in SCAN_TC_V_SLICES
    return v_slice, tensor_cores


def state_scan_kernel(
    a_op, b_op, decay, addend, cu_seqlens, y0, *, reverse: bool, v_slice=None, tensor_cores=None,
    passes=None, plain_addend=False, bf16_states=False,
):  # fmt: skip
    """xla.state_scan's contract, run by an sm90 state-scan kernel (no autodiff rule); the
    addend may come as SlicedAddend. v_slice, tensor_cores: the variant (kernels/layout.py
    SCAN_VARIANTS); None: scan_variant's. passes: bf16 passes a product of the tensor-core
    kernel (1 or 3); None: one there, and the float32 SIMT kernels' own arithmetic elsewhere.
    plain_addend: the forward tensor-core scan reads a bfloat16 addend (the chunk core's U) as
    it is, each CTA its slice (state_scan_artifact's variant), instead of a float32 V-sliced
    copy that XLA makes (6.0 / 28.3 us at 2048x12x1 / 8192x16x1 on the H200); the same
    values, so the same results (bit for bit on the H100, 2026-12-06); training_forward's
    default. bf16_states (forward): the chunk states come back in bf16 (BF16_STATES; stored so
    by the tensor-core kernels, rounded by XLA after the others). A reverse scan reads a bf16
    SlicedAddend of its width as it is (BF16_ADDEND)."""
    from jax_kda.sm90.ffi_call import cute_call

    num_heads, num_sequences = y0.shape[1], y0.shape[0]
    v_slice, tensor_cores = scan_variant(num_heads, num_sequences, v_slice, tensor_cores)
    bf16_addend = (
        reverse and tensor_cores and isinstance(addend, SlicedAddend)
        and addend.v_slice == v_slice and addend.slices.dtype == jnp.bfloat16
    )  # fmt: skip
    store_bf16 = bool(bf16_states and not reverse and tensor_cores)
    if passes is None:
        passes = 1 if tensor_cores else 3
    # the reverse tensor-core scan at one pass takes y0 and gives final as [V, K], prefill's
    # layout: the transposes here and the training backward's (d_final and d_initial_state, in
    # prefill's layout) cancel, where two transposes ran before (about 2.3 us each at
    # 2048x12x1, H100); the three-pass variant (opt-in) keeps [K, V], as it ran on the GPU
    state_vk = reverse and tensor_cores and passes == 1
    if state_vk:
        y0 = jnp.swapaxes(y0, -1, -2)
    plain_addend = (
        plain_addend and tensor_cores and not reverse and not isinstance(addend, SlicedAddend)
        and addend.dtype == jnp.bfloat16 and addend.shape[0] > 0
    )  # fmt: skip
    if plain_addend:
        slots, heads = addend.shape[:2]
        a_op, b_op, _ = state_scan_operands(a_op, b_op, None, v_slice, passes)
        addend = addend.reshape(slots, heads, SCAN_CHUNK * HEAD_DIM)
        # that variant takes y0 and gives final as [V, K], prefill's layout: these transposes
        # and xla.forward's cancel
        y0 = jnp.swapaxes(y0, -1, -2)
    elif tensor_cores:
        a_op, b_op, addend = state_scan_operands(a_op, b_op, addend, v_slice, passes)
    else:
        a_op, b_op = _values(a_op), _values(b_op)
        addend = _unsliced(addend).astype(jnp.float32)

    results = [
        jax.ShapeDtypeStruct(
            (a_op.shape[0], *y0.shape[1:]), jnp.bfloat16 if store_bf16 else jnp.float32
        ),
        jax.ShapeDtypeStruct(y0.shape, jnp.float32),
    ]
    inputs = [a_op, b_op, decay, addend, jnp.asarray(cu_seqlens, jnp.int32), y0]
    artifact = state_scan_artifact(
        reverse, v_slice, tensor_cores, passes, plain_addend, store_bf16, bf16_addend, state_vk
    )
    states, final = cute_call(artifact, inputs, results)
    if bf16_states and not reverse and not store_bf16:
        states = states.astype(jnp.bfloat16)
    return states, jnp.swapaxes(final, -1, -2) if plain_addend or state_vk else final


def differentiable_state_scan(run, precision=jax.lax.Precision.HIGHEST):
    """xla.state_scan's forward direction with a backward that is one more scan: `run` (the
    kernel, or xla.state_scan in CPU tests) over the chunks in reverse gives the state's
    cotangent at every chunk's end, and the rest is parallel over chunks (its products at
    `precision`)."""
    highest = precision

    @jax.custom_vjp
    def scan(w, kd, decay, u, cu_seqlens, y0):
        return run(w, kd, decay, u, cu_seqlens, y0, reverse=False)

    def scan_fwd(w, kd, decay, u, cu_seqlens, y0):
        states, final = run(w, kd, decay, u, cu_seqlens, y0, reverse=False)
        return (states, final), (w, kd, decay, u, cu_seqlens, states)

    def scan_bwd(residuals, cotangents):
        # S' = Diag(a) S + Kd^T V_new, V_new = U - W S; G = dL/dS' at each chunk's end.
        w, kd, decay, u, cu_seqlens, states = residuals
        d_states, d_final = cotangents
        g_end, d_y0 = run(kd, w, decay, d_states, cu_seqlens, d_final, reverse=True)
        d_u = jnp.einsum("shik,shkv->shiv", kd, g_end, precision=highest)
        v_new = u - jnp.einsum("shik,shkv->shiv", w, states, precision=highest)
        d_kd = jnp.einsum("shiv,shkv->shik", v_new, g_end, precision=highest)
        d_w = -jnp.einsum("shiv,shkv->shik", d_u, states, precision=highest)
        d_decay = jnp.sum(states * g_end, axis=-1)
        return d_w, d_kd, d_decay, d_u, None, d_y0

    scan.defvjp(scan_fwd, scan_bwd)

    def call(w, kd, decay, u, cu_seqlens, y0, *, reverse: bool):
        if reverse:
            raise ValueError("differentiable_state_scan runs the forward direction only")
        return scan(w, kd, decay, u, cu_seqlens, y0)

    return call


def differentiable_chunks(
    core, scan, chunk_bwd, precision=jax.lax.Precision.HIGHEST, state_cotangent=None,
    chunk_outputs=None, both_scans=None, primal_core=None, scan_outputs=None,
    primal_images=None, reverse_addend=None,
):  # fmt: skip
    """xla.forward's `chunks`: the packed tokens to (o [T, H, V] in the tokens' rows, final)
    through the chunk core (`core`: chunk_core_kernel's contract), the forward state scan
    (`scan`: state_scan_kernel's, or xla.state_scan) and the outputs after it, O = Qg S + Aqk
    (U - W S) (`chunk_outputs`: chunk_outputs_kernel's contract; None: xla_chunk_outputs), as
    one custom VJP (where `core` gives the scan images too, the scan takes W and Kd as
    ImagedOperand: `scan` is then state_scan_kernel). Its backward: the reverse scan, then
    `chunk_bwd` (xla_chunk_bwd's
    contract: every chunk's part, parallel over chunks, straight to the tokens' gradients); the
    reverse scan's addend, the outputs' part of each chunk's state cotangent, by
    `state_cotangent` (state_cotangent_kernel's contract; None: xla_state_cotangent).
    Residuals: the tokens, the core's outputs and the chunk states. Products outside the
    kernels at `precision`.

    both_scans (state_scans_kernel's contract): the backward runs the forward scan again beside
    the reverse one, in one launch, and the chunk states are no residual: in a training step
    whose primal outputs come from elsewhere (the forward kernels), the recompute's forward
    scan and outputs are then dead code that XLA drops, and the two serial chains overlap.

    primal_core: the core a call that is not differentiated runs (`core`'s contract for what
    the forward reads: w, u, qg, attn, kd, decay; chunk_core_kernel(residuals=False), which
    leaves the backward's arrays unwritten); None: `core`.

    scan_outputs (state_scan_outputs_kernel's contract): the forward scan and the outputs after
    it in one call (in place of `scan` and `chunk_outputs` there; `scan` still runs the
    reverse one).

    primal_images (with primal_core and scan_outputs): (heads, sequences, slots, tokens) ->
    whether a call that is not differentiated has primal_core write Qg and Aqk as the images
    scan_outputs' one launch takes (both called with images=True; scan_outputs_fused says
    where that launch runs).

    reverse_addend (reverse_scan_addend_kernel's contract; without both_scans): the reverse
    scan and its addend in one call (in place of `state_cotangent` and `scan`'s reverse)."""
    if primal_images is not None and (scan_outputs is None or primal_core is None):
        raise ValueError(
            "primal_images needs scan_outputs and primal_core (the one launch that takes the "
            "images and the forward-alone core that writes them)"
        )
    outputs = chunk_outputs or xla_chunk_outputs

    def scan_operands(core_out):
        # W and Kd; from chunk_core_kernel, their scan images with the values beside them
        # (which only the variants that take float32 operands compute)
        w, kd = core_out[0], core_out[4]
        if w.ndim == 3:
            return ImagedOperand(chunk_rows(w), w), ImagedOperand(chunk_rows(kd), kd)
        return w, kd

    def forward(
        q, k, v, g, beta, cu_seqlens, rows, y0, num_slots, scale, run_core=core, primal=False,
        undifferentiated=False,
    ):  # fmt: skip
        images = {}
        if undifferentiated and primal_images is not None:
            if primal_images(v.shape[1], y0.shape[0], num_slots, rows.shape[0]):
                images = {"images": True}
        core_out = run_core(q, k, v, g, beta, cu_seqlens, num_slots, scale, **images)
        w, u, qg, attn, _, decay = core_out[:6]
        w_op, kd_op = scan_operands(core_out)
        if scan_outputs is not None:  # a primal call keeps no chunk states
            states, final, o = scan_outputs(
                w_op, kd_op, decay, u, cu_seqlens, y0, qg, attn, rows, states=not primal,
                **images,
            )  # fmt: skip
            return (o, final), core_out, states
        states, final = scan(w_op, kd_op, decay, u, cu_seqlens, y0, reverse=False)
        o = outputs(states, w, u, qg, attn, cu_seqlens, rows, precision)
        return (o, final), core_out, states

    @functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
    def chunks(q, k, v, g, beta, cu_seqlens, rows, y0, num_slots, scale):
        args = (q, k, v, g, beta, cu_seqlens, rows, y0, num_slots, scale)
        return forward(*args, run_core=primal_core or core, primal=True, undifferentiated=True)[0]

    def chunks_fwd(q, k, v, g, beta, cu_seqlens, rows, y0, num_slots, scale):
        # with both_scans the backward scans the states again: the forward stores none
        primal, core_out, states = forward(
            q, k, v, g, beta, cu_seqlens, rows, y0, num_slots, scale,
            primal=both_scans is not None,
        )  # fmt: skip
        like = tuple(jnp.zeros((0,), x.dtype) for x in (q, k, v, g, beta))  # the dtypes
        if both_scans is not None:
            states = y0  # the backward's scans start from it
        return primal, ((q, k, v, g, beta), cu_seqlens, rows, core_out, states, like)

    def chunks_bwd(num_slots, scale, saved, cotangents):
        # S' = Diag(a) S + Kd^T V_new; dL/dS from the outputs is Qg^T dO - W^T Aqk^T dO, the
        # reverse scan's addend; it returns G = dL/dS' at every chunk's end.
        tokens, cu_seqlens, rows, core_out, states, like = saved
        w, u, qg, attn, _, decay = core_out[:6]
        d_o, d_final = cotangents
        w_op, kd_op = scan_operands(core_out)
        if both_scans is None and reverse_addend is not None:
            g_end, d_y0 = reverse_addend(
                kd_op, w_op, decay, qg, w, attn, d_o, cu_seqlens, rows, d_final
            )
            d_tokens = chunk_bwd(
                scale, tokens, cu_seqlens, rows, core_out, states, g_end, d_o, precision
            )
            d_tokens = [d.astype(x.dtype) for d, x in zip(d_tokens, like, strict=True)]
            return (*d_tokens, None, None, d_y0)
        d_states = (state_cotangent or xla_state_cotangent)(
            qg, w, attn, d_o, cu_seqlens, rows, precision
        )
        if both_scans is not None:
            states, _, g_end, d_y0 = both_scans(
                w_op, kd_op, decay, u, d_states, cu_seqlens, states, d_final
            )
        else:
            g_end, d_y0 = scan(kd_op, w_op, decay, d_states, cu_seqlens, d_final, reverse=True)
        d_tokens = chunk_bwd(
            scale, tokens, cu_seqlens, rows, core_out, states, g_end, d_o, precision
        )
        d_tokens = [d.astype(x.dtype) for d, x in zip(d_tokens, like, strict=True)]
        return (*d_tokens, None, None, d_y0)

    chunks.defvjp(chunks_fwd, chunks_bwd)
    # a call that is not differentiated, on a core of the caller's (prepared_forward)
    chunks.primal_forward = functools.partial(forward, primal=True, undifferentiated=True)
    return chunks


def xla_chunk_outputs(states, w, u, qg, attn, cu_seqlens, rows, precision):
    """Every chunk's outputs from the state entering it, O = Qg S + Aqk (U - W S), in the
    tokens' rows ([T, H, V] float32; states [slots, H, K, V], w, u, qg [slots, H, 64, 128] (w
    also as chunk_core_kernel gives it), attn [slots, H, 64, 64]), products at `precision`:
    chunk_outputs_kernel's statement."""
    del cu_seqlens  # the rows say where each token sits
    w, u, qg, attn = (chunk_rows(x) for x in (w, u, qg, attn))
    v_new = u - jnp.einsum("shik,shkv->shiv", w, states, precision=precision)
    return xla.from_chunks(xla._chunk_output(states, v_new, qg, attn, precision), rows)


def chunk_outputs_kernel(states, w, u, qg, attn, cu_seqlens, rows, precision=None):
    """xla_chunk_outputs's contract on the kernel, o in bfloat16 (one bf16 pass a product;
    `precision` is xla_chunk_outputs's and ignored here)."""
    from jax_kda.sm90.ffi_call import cute_call

    del precision
    slots, heads = u.shape[:2]
    result = jax.ShapeDtypeStruct((rows.shape[0], heads, HEAD_DIM), jnp.bfloat16)
    if slots == 0 or rows.shape[0] == 0:  # nothing to launch or nothing to write
        return jnp.zeros(result.shape, result.dtype)
    bf16 = jnp.bfloat16
    bf16_states = states.dtype == bf16  # the training forward's (BF16_STATES) as they are
    inputs = [states if bf16_states else states.astype(jnp.float32), chunk_image(w)]
    inputs += [x.astype(bf16) for x in (u, qg, attn)]
    (o,) = cute_call(
        chunk_outputs_artifact(bf16_states), [*inputs, jnp.asarray(cu_seqlens, jnp.int32)],
        [result],
    )  # fmt: skip
    return o


@functools.cache
def chunk_outputs_artifact(bf16_states: bool = False):
    """The exported chunk outputs (kernels/kda_chunk_outputs_sm90.py); tokens, heads, slots and
    sequences symbolic; bf16_states: the states come in bf16 (BF16_STATES), else float32."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from jax_kda.sm90.export import export, row_major_fake
    from jax_kda.sm90.kernels.kda_chunk_outputs_sm90 import ChunkOutputsSm90

    tokens, heads, slots = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    chunk = row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK, HEAD_DIM))
    fakes = {
        "states": row_major_fake(
            BFloat16 if bf16_states else Float32, (slots, heads, HEAD_DIM, HEAD_DIM)
        ),
        "w_img": row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK * HEAD_DIM)),
        "u": chunk,
        "qg": chunk,
        "attn": row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK, SCAN_CHUNK)),
        "cu_seqlens": row_major_fake(Int32, (cute.sym_int32(),), align=4),
        "o": row_major_fake(BFloat16, (tokens, heads, HEAD_DIM)),
    }
    config = {"bf16_states": True} if bf16_states else {}
    prefix = "kda_chunk_outputs_sm90" + ("_hs" if bf16_states else "")
    return export(ChunkOutputsSm90(), fakes, prefix=prefix, config=config)


def xla_state_cotangent(qg, w, attn, d_o, cu_seqlens, rows, precision=jax.lax.Precision.HIGHEST):
    """The outputs' part of each chunk's state cotangent, dL/dS = Qg^T dO - W^T (Aqk^T dO)
    ([slots, H, K, V]; qg, w [slots, H, 64, 128], attn [slots, H, 64, 64], d_o [T, H, V] in
    the tokens' rows), products at `precision`: state_cotangent_kernel's statement."""
    del cu_seqlens  # the rows say where each token sits
    qg, w, attn = (chunk_rows(x) for x in (qg, w, attn))
    d_out = xla._to_chunks(d_o.astype(jnp.float32), rows, qg.shape[0])
    mm = functools.partial(jnp.einsum, precision=precision)
    return mm("shik,shiv->shkv", qg, d_out) - mm(
        "shik,shiv->shkv", w, mm("shji,shjv->shiv", attn, d_out)
    )


@functools.cache
def state_cotangent_artifact(v_slice: int = 0, bf16: bool = False):
    """The exported outputs' part of the state cotangent (kernels/kda_state_cotangent_sm90.py);
    slots and heads symbolic; v_slice > 0: written in the tensor-core scan's V slices of that
    width (StateCotangentConfig), in bf16 where `bf16` (BF16_ADDEND), else float32."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from jax_kda.sm90.export import export, row_major_fake
    from jax_kda.sm90.kernels.kda_state_cotangent_sm90 import (
        StateCotangentConfig,
        StateCotangentSm90,
    )

    slots, heads = cute.sym_int32(), cute.sym_int32()
    fakes = {
        "qg": row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK, HEAD_DIM)),
        "w_img": row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK * HEAD_DIM)),
        "attn": row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK, SCAN_CHUNK)),
        "d_out": row_major_fake(BFloat16, (cute.sym_int32(), heads, HEAD_DIM)),
        "cu_seqlens": row_major_fake(Int32, (cute.sym_int32(),), align=4),
        "d_states": row_major_fake(
            BFloat16 if bf16 else Float32, (slots, heads, HEAD_DIM, HEAD_DIM)
        ),
    }
    if bf16 and not v_slice:
        raise ValueError("the state cotangent comes in bf16 only in the scan's V slices")
    config = StateCotangentConfig(v_slice)
    prefix = "kda_state_cotangent_sm90" + (f"_vs{v_slice}" if v_slice else "")
    prefix += "h" if bf16 else ""
    extra = {"bf16": True} if bf16 else {}
    return export(
        StateCotangentSm90(config), fakes, prefix=prefix, config={**vars(config), **extra}
    )


def state_cotangent_kernel(
    qg, w, attn, d_o, cu_seqlens, rows, precision=None, *, scan_v_slice=None,
    scan_tensor_cores=None, bf16=False,
):  # fmt: skip
    """xla_state_cotangent's contract on the kernel (one bf16 pass a product, d_o taken as
    bfloat16; rows and `precision` are xla_state_cotangent's and unused here). Where the
    reverse scan that takes it (scan_variant of scan_v_slice, scan_tensor_cores and the
    shapes) runs on tensor cores, the result comes as SlicedAddend in that scan's slices,
    in bf16 where `bf16` (BF16_ADDEND: the reverse scan reads it so), else float32."""
    from jax_kda.sm90.ffi_call import cute_call

    del rows, precision
    slots, heads = qg.shape[:2]
    v_slice, tensor_cores = scan_variant(
        heads, cu_seqlens.shape[0] - 1, scan_v_slice, scan_tensor_cores
    )
    v_slice = v_slice if tensor_cores else 0
    bf16 = bool(bf16 and v_slice)
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    result = jax.ShapeDtypeStruct((slots, heads, HEAD_DIM, HEAD_DIM), dtype)
    if slots == 0:  # no chunk slots: nothing to launch (an empty grid)
        d_states = jnp.zeros(result.shape, result.dtype)
    else:
        b16 = jnp.bfloat16
        inputs = [qg.astype(b16), chunk_image(w), attn.astype(b16)]
        inputs += [d_o.astype(b16), jnp.asarray(cu_seqlens, jnp.int32)]
        (d_states,) = cute_call(state_cotangent_artifact(v_slice, bf16), inputs, [result])
    if not v_slice:
        return d_states
    slices = d_states.reshape(slots, heads, HEAD_DIM // v_slice, HEAD_DIM * v_slice)
    return SlicedAddend(slices, v_slice)


def xla_chunk_bwd(
    scale, tokens, cu_seqlens, rows, core_out, states, g_end, d_o, precision,
    dense_bwd=None, decayed_bwd=None, tokens_bwd=None, decayed_tokens_bwd=None,
):  # fmt: skip
    """Every chunk's part of the backward, straight to the tokens: tokens = (q, k, v, g, beta)
    packed (g as given: dg goes through the gate floor here); core_out: the chunk core's
    outputs (chunk_core_kernel's or its stand-in's nine); states: the state entering each slot,
    g_end the cotangent of the state leaving it (the reverse scan's), d_o the outputs'
    cotangent [T, H, V] in the tokens' rows. Returns (dq, dk, dv, dg, dbeta) in the tokens' rows,
    float32. Three stages, each by its kernel's contract or (None) its XLA statement: the dense
    products' and the solve's backward (`dense_bwd`: dense_bwd_kernel; xla_dense_bwd), the
    decayed products' (`decayed_bwd`: decayed_bwd_tokens_kernel; xla_decayed_bwd_tokens), then
    the element-wise terms back into the tokens' rows (`tokens_bwd`: tokens_bwd_kernel;
    xla_tokens_bwd); `decayed_tokens_bwd` (decayed_tokens_bwd_kernel) takes the last two in
    one."""
    gamma, kk, t_inverse = core_out[6:9]
    w, u, _, attn, kd = core_out[:5]
    d_rhs, d_qg, d_attn, d_kd, d_decay, d_kk, d_beta_kk = (dense_bwd or xla_dense_bwd)(
        w, u, attn, kd, states, g_end, d_o, t_inverse, kk, tokens[4], cu_seqlens, rows, precision
    )
    cotangents = (d_rhs, d_beta_kk, d_qg, d_kd, d_decay)
    if decayed_tokens_bwd is not None:
        return decayed_tokens_bwd(scale, tokens, cu_seqlens, rows, d_kk, d_attn, cotangents)
    # both read the cotangents for j <= i only
    decayed = decayed_bwd or xla_decayed_bwd_tokens
    d_decayed = decayed(scale, tokens[0], tokens[1], cu_seqlens, rows, gamma, d_kk, d_attn)
    return (tokens_bwd or xla_tokens_bwd)(
        scale, tokens, cu_seqlens, rows, gamma, d_decayed, cotangents
    )


def xla_tokens_bwd(scale, tokens, cu_seqlens, rows, gamma, d_decayed, cotangents):
    """tokens_bwd_kernel's contract in XLA: xla._elementwise_bwd on the chunked tokens (q, k,
    v, beta of tokens = (q, k, v, g, beta)), gamma [slots, H, 64, 128] and the decayed
    products' backward (dq_c, dk_c, dgamma_c), cotangents (d_rhs, d_beta_kk, d_qg, d_kd,
    d_decay) as dense_bwd_kernel gives them (any float dtype); dg through the gate floor
    (xla.gate_floor_grad of the tokens' g); returns (dq, dk, dv, dg, dbeta) float32 in the
    tokens' rows."""
    del cu_seqlens  # the rows say where each token sits
    num_slots = gamma.shape[0]
    q, k, v, g, beta = tokens
    chunked = [xla._to_chunks(x.astype(jnp.float32), rows, num_slots) for x in (q, k, v, beta)]
    cotangents = tuple(x.astype(jnp.float32) for x in cotangents)  # the kernel's are bf16 in part
    d_chunked = xla._elementwise_bwd(scale, (*chunked, gamma), d_decayed, cotangents)
    dq, dk, dv, dg, dbeta = (xla.from_chunks(d, rows) for d in d_chunked)
    return dq, dk, dv, xla.gate_floor_grad(g, dg), dbeta


@functools.cache
def chunk_operands_artifact(
    scale: float, passes: int = 3, residuals: bool = True, images: bool = False, prep=None,
    stamps: bool = False, keep_gamma: bool = True,
):  # fmt: skip
    """The exported exact 64-token chunk core (kernels/kda_chunk_operands_sm90.py) for this
    scale; tokens, heads, slots and sequences symbolic; `passes` bf16 passes a product (3:
    bf16x3; 1: one); residuals=False: the forward-alone variant, which leaves gamma, kk and tinv
    (the backward's) unwritten; images=True (with residuals=False and one pass): its variant
    that writes qg and attn as the K-major operand images the scan with the outputs takes
    (flat [slots, H, 64 * 128] and [slots, H, 64 * 64] in W's order,
    chunk_io.scan_order_offset). prep (kernels' InputPrep, or None): the inputs prepared in the
    kernel as they load (l2-normalised q and k, the gate from its raw projection, beta from
    logits; chunk_core_kernel says what it takes then). stamps (a
    diagnostic, with prep None): a variant that also writes each CTA's phase clocks
    (kernels' STAMPS, benchmarks/chunk_core_phases.py reads them). keep_gamma=False (with
    residuals): gamma is left unwritten too (the training path's: its fused backward sums g
    into Gamma itself)."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from jax_kda.sm90.export import export, row_major_fake
    from jax_kda.sm90.kernels.kda_chunk_operands_sm90 import (
        STAMPS,
        ChunkOperandsConfig,
        ChunkOperandsGateSm90,
        ChunkOperandsSm90,
        ChunkOperandsStampsSm90,
        InputPrep,
    )

    if prep == InputPrep():
        prep = None  # nothing prepared: the plain kernel
    if stamps and prep is not None:
        raise ValueError("stamps=True is a variant of the chunk core without in-kernel prep")

    if images and (residuals or passes != 1):
        raise ValueError("images=True is a variant of the one-pass forward-alone chunk core")
    if not keep_gamma and not residuals:
        raise ValueError("keep_gamma=False is a variant of the chunk core with residuals")
    tokens, heads, slots = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    token_shape = (tokens, heads, HEAD_DIM)
    chunk = (slots, heads, SCAN_CHUNK, HEAD_DIM)
    pairs = (slots, heads, SCAN_CHUNK, SCAN_CHUNK)
    qk_shape = token_shape
    if prep is not None and prep.grouped_qk:  # q and k with heads of their own
        qk_shape = (tokens, cute.sym_int32(), HEAD_DIM)
    fakes = {
        "q": row_major_fake(BFloat16, qk_shape),
        "k": row_major_fake(BFloat16, qk_shape),
        "v": row_major_fake(BFloat16, token_shape),
        "g": row_major_fake(Float32, token_shape),
        "beta": row_major_fake(Float32, (tokens, heads), align=4),
        "cu_seqlens": row_major_fake(Int32, (cute.sym_int32(),), align=4),
    }
    if prep is not None and prep.gate:
        fakes["a_log"] = row_major_fake(Float32, (heads,), align=4)
        fakes["dt_bias"] = row_major_fake(Float32, (heads, HEAD_DIM))
    fakes |= {
        **{name: row_major_fake(BFloat16, chunk) for name in ("u", "qg")},
        "attn": row_major_fake(BFloat16, pairs),
        "decay": row_major_fake(Float32, (slots, heads, HEAD_DIM)),
        "gamma": row_major_fake(Float32, chunk),
        "kk": row_major_fake(Float32, pairs),
        "tinv": row_major_fake(BFloat16, pairs),
        "w_img": row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK * HEAD_DIM)),
        "kd_img": row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK * HEAD_DIM)),
    }
    if images:
        fakes["qg"] = row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK * HEAD_DIM))
        fakes["attn"] = row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK * SCAN_CHUNK))
    if stamps:
        fakes["stamps"] = row_major_fake(Int32, (slots, heads, len(STAMPS)), align=4)
    scale_tag = hashlib.sha256(repr(scale).encode()).hexdigest()[:8]
    suffix = ("" if passes == 3 else f"_x{passes}") + ("" if residuals else "_fwd")
    suffix += "_img" if images else ""
    config = {"scale": repr(scale)} if passes == 3 else {"scale": repr(scale), "passes": passes}
    if not residuals:
        config["residuals"] = False
    if not keep_gamma:
        config["gamma"] = False
        suffix += "_ng"
    if images:
        config["images"] = True
    if prep is not None:
        config["prep"] = repr(prep)
        gate_tag = "s" if prep.lower_bound is None else "l"  # softplus, or lower-bounded
        suffix += "_prep" + "".join(
            tag for tag, on in (("n", prep.qk_l2norm), (gate_tag, prep.gate),
                                ("b", prep.beta_logits), ("gv", prep.grouped_qk)) if on
        )  # fmt: skip
    if stamps:
        config["stamps"] = True
        suffix += "_stamps"
    core_config = ChunkOperandsConfig(
        scale=scale, passes=passes, residuals=residuals, images=images, prep=prep, stamps=stamps,
        gamma=keep_gamma,
    )  # fmt: skip
    launcher = ChunkOperandsGateSm90 if prep is not None and prep.gate else ChunkOperandsSm90
    if stamps:
        launcher = ChunkOperandsStampsSm90
    return export(
        launcher(core_config),
        fakes,
        prefix=f"kda_chunk_operands_sm90{suffix}_{scale_tag}",
        config=config,
    )


def chunk_core_results(num_slots: int, heads: int, images: bool = False):
    """The chunk-core artifact's results in its order: u, qg, attn, decay, gamma, kk, tinv,
    w_img, kd_img (chunk_core_kernel says what they hold); with images, qg and attn flat."""
    chunk = (num_slots, heads, SCAN_CHUNK, HEAD_DIM)
    pairs = (num_slots, heads, SCAN_CHUNK, SCAN_CHUNK)
    image = (num_slots, heads, SCAN_CHUNK * HEAD_DIM)
    qg, attn = (image, (num_slots, heads, SCAN_CHUNK * SCAN_CHUNK)) if images else (chunk, pairs)
    f32, bf16 = jnp.float32, jnp.bfloat16
    shapes = [(chunk, bf16), (qg, bf16), (attn, bf16), ((num_slots, heads, HEAD_DIM), f32),
              (chunk, f32), (pairs, f32), (pairs, bf16), (image, bf16), (image, bf16)]  # fmt: skip
    return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]


def chunk_core_kernel(
    q, k, v, g, beta, cu_seqlens, num_slots, scale, passes=3, residuals=True, images=False,
    prep=None, a_log=None, dt_bias=None, keep_gamma=True,
):  # fmt: skip
    """The chunk-core kernel: (w, u, qg, attn, kd, decay, gamma, kk, tinv) from the packed
    tokens, xla_chunk_core's contract with tinv = T^-1, T = I + strictLower(beta kk), and
    these types: w and kd bfloat16 [slots, H, 64 * 128] in the single-pass tensor-core scan's
    operand order (state_scan_operands' a_img / bt_img of them; chunk_rows gives their
    values), u, qg, attn and tinv bfloat16 (every consumer takes them as bf16 operands, U
    as V_new's addend too), decay, gamma and kk float32. residuals=False (a forward alone):
    gamma, kk and tinv, which only the backward reads, are not written and come back as
    None. images=True (with residuals=False, one pass): qg and attn come as the scan's K-major
    operand images, flat (chunk_operands_artifact's variant; state_scan_outputs_kernel's
    images take them). prep (the kernels' InputPrep): q and k with H
    heads against v's HV = G H where prep.grouped_qk, raw where prep.qk_l2norm; g the raw
    gate projection a (cast to float32) where prep.gate, with a_log [HV] and dt_bias
    [HV, 128] or [HV * 128] (None: zeros, fla's defaults of amplitude 1 and no bias); beta
    logits where prep.beta_logits; the results are those of the prepared inputs (gate.py
    states each preparation). keep_gamma=False (with residuals): gamma is not written either
    and comes back as None (for decayed_tokens_bwd_kernel, which sums g into it itself)."""
    from jax_kda.sm90.ffi_call import cute_call
    from jax_kda.sm90.kernels.input_prep import InputPrep

    f32 = jnp.float32
    heads = v.shape[1]
    results = chunk_core_results(num_slots, heads, images)
    if any(x.dtype != jnp.bfloat16 for x in (q, k, v)):
        raise TypeError(f"the chunk-core kernel takes bfloat16 q, k, v; got {q.dtype}")
    _check_prepared_heads(q, k, heads, InputPrep() if prep is None else prep, a_log, dt_bias)
    if not keep_gamma and not residuals:
        raise ValueError("keep_gamma=False is a variant of the chunk core with residuals")
    if num_slots == 0:  # no tokens and no sequences: nothing to launch (an empty grid)
        u, qg, attn, decay, gamma, kk, tinv, w, kd = (jnp.zeros(r.shape, r.dtype) for r in results)
    else:
        inputs = [q, k, v, g.astype(f32), beta.astype(f32), jnp.asarray(cu_seqlens, jnp.int32)]
        if prep is not None and prep.gate:
            inputs += _gate_parameters(heads, a_log, dt_bias)
        artifact = chunk_operands_artifact(
            scale, passes, residuals, images, prep, keep_gamma=keep_gamma
        )
        u, qg, attn, decay, gamma, kk, tinv, w, kd = cute_call(artifact, inputs, results)
    if not residuals:
        gamma = kk = tinv = None
    if not keep_gamma:
        gamma = None
    return w, u, qg, attn, kd, decay, gamma, kk, tinv


def chunk_core_stamps(q, k, v, g, beta, cu_seqlens, num_slots, scale, passes=1, residuals=False):
    """A diagnostic: the chunk core's stamps variant on these inputs (chunk_core_kernel's),
    returning only each (slot, head) CTA's clocks, int32 [slots, H, len(STAMPS)] (the kernel
    module's STAMPS says what each holds; benchmarks/chunk_core_phases.py reads them)."""
    from jax_kda.sm90.ffi_call import cute_call
    from jax_kda.sm90.kernels.kda_chunk_operands_sm90 import STAMPS

    f32 = jnp.float32
    heads = v.shape[1]
    if num_slots == 0 or any(x.dtype != jnp.bfloat16 for x in (q, k, v)):
        raise ValueError("chunk_core_stamps: wants chunk slots and bfloat16 q, k, v")
    results = [
        *chunk_core_results(num_slots, heads),
        jax.ShapeDtypeStruct((num_slots, heads, len(STAMPS)), jnp.int32),
    ]
    inputs = [q, k, v, g.astype(f32), beta.astype(f32), jnp.asarray(cu_seqlens, jnp.int32)]
    artifact = chunk_operands_artifact(scale, passes, residuals, stamps=True)
    return cute_call(artifact, inputs, results)[-1]


@functools.cache
def decayed_bwd_artifact(
    from_tokens: bool = False, qk_scale: float = 1.0, bf16_cotangents: bool | None = None
):
    """The exported backward of the in-chunk decayed products (kernels/kda_decayed_bwd_sm90.py)
    on chunked q and k or (from_tokens) on the tokens' rows, d_qk scaled by qk_scale as it
    loads; cotangents d_kk and d_qk bfloat16 (the dense kernel's; the default from the tokens)
    or float32 (the chunked variant's, and the XLA dense backward's at a dense_precision above
    bf16); slots, heads (and tokens and sequences) symbolic."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from jax_kda.sm90.export import export, row_major_fake
    from jax_kda.sm90.kernels.kda_decayed_bwd_sm90 import DecayedBwdConfig, DecayedBwdSm90

    slots, heads = cute.sym_int32(), cute.sym_int32()
    chunk = (slots, heads, SCAN_CHUNK, HEAD_DIM)
    pairs = (slots, heads, SCAN_CHUNK, SCAN_CHUNK)
    rows = (cute.sym_int32(), heads, HEAD_DIM) if from_tokens else chunk
    if bf16_cotangents is None:
        bf16_cotangents = from_tokens
    if bf16_cotangents and not from_tokens:
        raise ValueError("bf16 cotangents are the tokens' variant's (from_tokens=True)")
    cotangent = BFloat16 if bf16_cotangents else Float32
    fakes = {
        "q": row_major_fake(BFloat16, rows),
        "k": row_major_fake(BFloat16, rows),
        "cu_seqlens": row_major_fake(Int32, (cute.sym_int32(),), align=4),
        "gamma": row_major_fake(Float32, chunk),
        "d_kk": row_major_fake(cotangent, pairs),
        "d_qk": row_major_fake(cotangent, pairs),
        **{name: row_major_fake(Float32, chunk) for name in ("dq", "dk", "dgamma")},
    }
    prefix = "kda_decayed_bwd_sm90"
    if from_tokens:  # one export a scale, as the tokens' backward
        tag = hashlib.sha256(repr(qk_scale).encode()).hexdigest()[:8]
        dtype_tag = "" if bf16_cotangents else "_f32"
        prefix = f"kda_decayed_bwd_tokens_sm90{dtype_tag}_{tag}"
    config = DecayedBwdConfig(from_tokens=from_tokens, qk_scale=qk_scale)
    options = {"from_tokens": from_tokens, "qk_scale": repr(qk_scale)}
    if not bf16_cotangents and from_tokens:
        options["cotangents"] = "float32"
    return export(DecayedBwdSm90(config), fakes, prefix=prefix, config=options)


def _decayed_bwd_call(q, k, cu_seqlens, gamma, d_kk, d_qk, from_tokens: bool, qk_scale=1.0):
    from jax_kda.sm90.ffi_call import cute_call

    if gamma.shape[0] == 0:
        return tuple(jnp.zeros(gamma.shape, jnp.float32) for _ in range(3))
    # the tokens' variant takes the cotangents in their dtype: bf16 from the dense kernel,
    # float32 from xla_dense_bwd (never rounded on the way in)
    bf16 = from_tokens and d_kk.dtype == jnp.bfloat16 and d_qk.dtype == jnp.bfloat16
    cotangent = jnp.bfloat16 if bf16 else jnp.float32
    inputs = [
        q.astype(jnp.bfloat16),
        k.astype(jnp.bfloat16),
        jnp.asarray(cu_seqlens, jnp.int32),
        gamma.astype(jnp.float32),
        *(x.astype(cotangent) for x in (d_kk, d_qk)),
    ]
    results = [jax.ShapeDtypeStruct(gamma.shape, jnp.float32) for _ in range(3)]
    artifact = decayed_bwd_artifact(from_tokens, qk_scale, bf16)
    return tuple(cute_call(artifact, inputs, results))


def decayed_bwd_kernel(residuals, cotangents):
    """xla._decayed_products_bwd's contract ((q, k, gamma), (d_kk, d_qk) -> dq, dk, dgamma,
    float32 chunks) on the kernel; q and k are taken as bfloat16 (the sm90 path's are)."""
    q, k, gamma = residuals
    unread = jnp.zeros((1,), jnp.int32)  # the chunked variant's cu_seqlens
    return _decayed_bwd_call(q, k, unread, gamma, *cotangents, from_tokens=False)


def xla_decayed_bwd_tokens(scale, q, k, cu_seqlens, rows, gamma, d_kk, d_attn):
    """decayed_bwd_tokens_kernel's contract in XLA: xla._decayed_products_bwd on the chunks of
    q and k [T, H, 128] (the tokens' rows), gamma and the cotangents d_kk and d_qk = scale
    d_attn [slots, H, 64, 64] (j <= i read; float32 or bfloat16); returns float32 (dq, dk,
    dgamma) chunks."""
    del cu_seqlens  # the rows say where each token sits
    num_slots = gamma.shape[0]
    q_c, k_c = (xla._to_chunks(x.astype(jnp.float32), rows, num_slots) for x in (q, k))
    d_kk, d_attn = (x.astype(jnp.float32) for x in (d_kk, d_attn))
    return xla._decayed_products_bwd((q_c, k_c, gamma), (d_kk, scale * d_attn))


def decayed_bwd_tokens_kernel(scale, q, k, cu_seqlens, rows, gamma, d_kk, d_attn):
    """xla_decayed_bwd_tokens's contract on the kernel (q and k taken as bfloat16 and read from
    the tokens' rows, d_kk and d_attn in their dtype: both bf16, or else float32; d_attn scaled
    as it loads; rows unused)."""
    del rows
    return _decayed_bwd_call(
        q, k, cu_seqlens, gamma, d_kk, d_attn, from_tokens=True, qk_scale=float(scale)
    )


@functools.cache
def dense_bwd_artifact(bf16_states: bool = False):
    """The exported backward of the chunk's dense products and solve
    (kernels/kda_dense_bwd_sm90.py); tokens, slots, heads and sequences symbolic. bf16_states:
    the chunk states S come in bf16 (as the training forward's scans store them, BF16_STATES)
    rather than float32."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from jax_kda.sm90.export import export, row_major_fake
    from jax_kda.sm90.kernels.kda_dense_bwd_sm90 import DenseBwdSm90

    slots, heads, tokens = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    bf16_chunk = row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK, HEAD_DIM))
    pairs = row_major_fake(Float32, (slots, heads, SCAN_CHUNK, SCAN_CHUNK))
    bf16_pairs = row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK, SCAN_CHUNK))
    image = row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK * HEAD_DIM))
    square = row_major_fake(Float32, (slots, heads, HEAD_DIM, HEAD_DIM))
    rows = row_major_fake(Float32, (slots, heads, SCAN_CHUNK))
    fakes = {
        "w_img": image,
        "u": row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK, HEAD_DIM)),
        "attn": bf16_pairs,
        "kd_img": image,
        "states": (
            row_major_fake(BFloat16, (slots, heads, HEAD_DIM, HEAD_DIM)) if bf16_states else square
        ),
        "g_end": square,
        "d_out": row_major_fake(BFloat16, (tokens, heads, HEAD_DIM)),
        "tinv": bf16_pairs,
        "kk": pairs,
        "beta": row_major_fake(Float32, (tokens, heads), align=4),
        "cu_seqlens": row_major_fake(Int32, (cute.sym_int32(),), align=4),
        "d_rhs": row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK, 2 * HEAD_DIM)),
        "d_qg": bf16_chunk,
        "d_attn": bf16_pairs,
        "d_kd": bf16_chunk,
        "d_decay": row_major_fake(Float32, (slots, heads, HEAD_DIM)),
        "d_kk": bf16_pairs,
        "d_beta_kk": rows,
    }
    config = {"bf16_states": True} if bf16_states else {}
    prefix = "kda_dense_bwd_sm90" + ("_hs" if bf16_states else "")
    return export(DenseBwdSm90(), fakes, prefix=prefix, config=config)


def dense_bwd_results(num_slots: int, heads: int):
    """The dense kernel's results in order: d_rhs [slots, H, 64, 256], d_qg, d_attn, d_kd,
    d_decay, d_kk, d_beta_kk (xla_dense_bwd's shapes); d_decay and d_beta_kk float32 (sums
    over a row), the rest bfloat16 (the operands of the decayed and tokens kernels' products
    and element-wise terms; benchmarks.precision_study --intermediates measures the cost)."""
    f32, bf16 = jnp.float32, jnp.bfloat16
    chunk = (num_slots, heads, SCAN_CHUNK, HEAD_DIM)
    pairs = (num_slots, heads, SCAN_CHUNK, SCAN_CHUNK)
    shapes = [((num_slots, heads, SCAN_CHUNK, 2 * HEAD_DIM), bf16), (chunk, bf16),
              (pairs, bf16), (chunk, bf16), ((num_slots, heads, HEAD_DIM), f32), (pairs, bf16),
              ((num_slots, heads, SCAN_CHUNK), f32)]  # fmt: skip
    return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]


def dense_bwd_kernel(
    w, u, attn, kd, states, g_end, d_o, t_inverse, kk, beta, cu_seqlens, rows, precision=None
):  # fmt: skip
    """xla_dense_bwd's contract on the kernel (one bf16 pass a product, Kd G two, d_o taken as
    bfloat16; rows and `precision` are xla_dense_bwd's and unused here), with d_rhs, d_qg,
    d_attn, d_kd and d_kk in bfloat16 (dense_bwd_results). States in bf16 (the training
    forward's, BF16_STATES) go in as they are, any other dtype as float32."""
    from jax_kda.sm90.ffi_call import cute_call

    del rows, precision
    f32, bf16 = jnp.float32, jnp.bfloat16
    bf16_states = states.dtype == bf16
    slots, heads = u.shape[:2]
    results = dense_bwd_results(slots, heads)
    if slots == 0:  # no chunk slots: nothing to launch (an empty grid)
        return tuple(jnp.zeros(r.shape, r.dtype) for r in results)
    inputs = [chunk_image(w), u.astype(bf16), attn.astype(bf16), chunk_image(kd)]
    inputs += [states if bf16_states else states.astype(f32), g_end.astype(f32)]
    inputs += [d_o.astype(bf16), t_inverse.astype(bf16), kk.astype(f32)]
    inputs += [beta.astype(f32), jnp.asarray(cu_seqlens, jnp.int32)]
    return tuple(cute_call(dense_bwd_artifact(bf16_states), inputs, results))


def xla_dense_products_bwd(
    w, u, attn, kd, states, g_end, d_out, precision=jax.lax.Precision.HIGHEST
):
    """The dense products' backward in XLA: with S = states (entering each slot, [slots, H, K,
    V]), G = g_end (the cotangent of the state leaving it) and dO = d_out ([slots, H, 64, V]):
    V_new = U - W S, dV = Aqk^T dO + Kd G; returns (d_w = -dV S^T, d_u = dV, d_qg = dO S^T,
    d_attn = dO V_new^T, d_kd = V_new G^T, d_decay = rowsum(S * G)). Products at
    `precision`, Kd G as Kd G_hi + Kd G_lo (G split into bf16 hi and the rest: the dense
    kernel's two passes, since G's rounding alone costs dbeta up to 1.1e-2 rms; at float32
    precision the same product)."""
    mm = functools.partial(jnp.einsum, precision=precision)
    v_new = u - mm("shik,shkv->shiv", w, states)
    g_hi = jax.lax.reduce_precision(g_end, exponent_bits=8, mantissa_bits=7)  # bf16, kept by XLA
    d_v = mm("shji,shjv->shiv", attn, d_out) + mm("shik,shkv->shiv", kd, g_hi)
    d_v = d_v + mm("shik,shkv->shiv", kd, g_end - g_hi)
    d_w = -mm("shiv,shkv->shik", d_v, states)
    d_qg = mm("shiv,shkv->shik", d_out, states)
    d_attn = mm("shiv,shjv->shij", d_out, v_new)
    d_kd = mm("shiv,shkv->shik", v_new, g_end)
    d_decay = jnp.sum(states * g_end, axis=-1)
    return d_w, d_v, d_qg, d_attn, d_kd, d_decay


def xla_dense_bwd(
    w, u, attn, kd, states, g_end, d_o, t_inverse, kk, beta, cu_seqlens, rows,
    precision=jax.lax.Precision.HIGHEST,
):  # fmt: skip
    """dense_bwd_kernel's contract in XLA: xla_dense_products_bwd, then the solve's backward
    (xla._solve_bwd with T^-1 = t_inverse, kk and beta), d_o [T, H, V] and beta [T, H] in the
    tokens' rows. Returns (d_rhs [slots, H, 64, 256], d_qg, d_attn, d_kd, d_decay, d_kk,
    d_beta_kk)."""
    del cu_seqlens  # the rows say where each token sits
    w, u, attn, kd, t_inverse = (chunk_rows(x) for x in (w, u, attn, kd, t_inverse))
    num_slots = w.shape[0]
    d_out, beta = (xla._to_chunks(x.astype(jnp.float32), rows, num_slots) for x in (d_o, beta))
    d_w, d_u, d_qg, d_attn, d_kd, d_decay = xla_dense_products_bwd(
        w, u, attn, kd, states, g_end, d_out, precision
    )
    solved = jnp.concatenate([w, u], axis=-1)
    d_rhs, d_kk, d_beta_kk = xla._solve_bwd(d_w, d_u, beta, kk, None, solved, t_inverse, precision)
    return d_rhs, d_qg, d_attn, d_kd, d_decay, d_kk, d_beta_kk


def _token_rows_fakes(tokens, heads):
    """The fake tensors the tokens' backward kernels share, (inputs, results): q, k, v
    bfloat16, g float32 [T, H, 128], beta [T, H], cu_seqlens; dq, dk, dv bfloat16, dg float32
    [T, H, 128] and dbeta's two partial sums [2, T, H]."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from jax_kda.sm90.export import row_major_fake

    token_shape = (tokens, heads, HEAD_DIM)
    inputs = {
        **{name: row_major_fake(BFloat16, token_shape) for name in ("q", "k", "v")},
        "g": row_major_fake(Float32, token_shape),
        "beta": row_major_fake(Float32, (tokens, heads), align=4),
        "cu_seqlens": row_major_fake(Int32, (cute.sym_int32(),), align=4),
    }
    results = {
        **{name: row_major_fake(BFloat16, token_shape) for name in ("dq", "dk", "dv")},
        "dg": row_major_fake(Float32, token_shape),
        "dbeta": row_major_fake(Float32, (2, tokens, heads), align=4),  # partial sums
    }
    return inputs, results


@functools.cache
def tokens_bwd_artifact(scale: float, bf16_cotangents: bool = True):
    """The exported backward from the chunk core's products' cotangents to the tokens
    (kernels/kda_tokens_bwd_sm90.py) for this scale, d_rhs, d_qg and d_kd bfloat16 (the dense
    kernel's) or float32 (xla_dense_bwd's); tokens, heads, slots and sequences symbolic."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32

    from jax_kda.sm90.export import export, row_major_fake
    from jax_kda.sm90.kernels.kda_tokens_bwd_sm90 import TokensBwdConfig, TokensBwdSm90

    tokens, heads, slots = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    chunk = (slots, heads, SCAN_CHUNK, HEAD_DIM)
    cotangent = BFloat16 if bf16_cotangents else Float32
    token_inputs, token_results = _token_rows_fakes(tokens, heads)
    fakes = {
        **token_inputs,
        **{name: row_major_fake(Float32, chunk) for name in ("gamma", "dq_c", "dk_c", "dgamma_c")},
        "d_rhs": row_major_fake(cotangent, (slots, heads, SCAN_CHUNK, 2 * HEAD_DIM)),
        **{name: row_major_fake(cotangent, chunk) for name in ("d_qg", "d_kd")},
        "d_decay": row_major_fake(Float32, (slots, heads, HEAD_DIM)),
        "d_beta_kk": row_major_fake(Float32, (slots, heads, SCAN_CHUNK)),
        **token_results,
    }
    scale_tag = hashlib.sha256(repr(scale).encode()).hexdigest()[:8]
    dtype_tag = "" if bf16_cotangents else "_f32"
    config = {"scale": repr(scale)}
    if not bf16_cotangents:
        config["cotangents"] = "float32"
    return export(
        TokensBwdSm90(TokensBwdConfig(scale=scale)),
        fakes,
        prefix=f"kda_tokens_bwd_sm90{dtype_tag}_{scale_tag}",
        config=config,
    )


def tokens_bwd_call(scale, tokens, cu_seqlens, gamma, d_decayed, cotangents):
    """tokens_bwd_kernel's kernel call, unlaunched: (artifact, inputs, results); tokens = (q,
    k, v, g, beta). The results are dq, dk, dv, dg and dbeta's two partial sums [2, T, H]:
    tokens_bwd_results adds them."""
    q, k, v, g, beta = tokens
    d_rhs, d_beta_kk, d_qg, d_kd, d_decay = cotangents
    f32 = jnp.float32
    results = token_grad_results(q)
    bf16 = jnp.bfloat16
    # d_rhs, d_qg, d_kd in their dtype: all bf16 (the dense kernel's), or else float32
    # (xla_dense_bwd's, never rounded on the way in)
    bf16_cotangents = all(x.dtype == bf16 for x in (d_rhs, d_qg, d_kd))
    cotangent = bf16 if bf16_cotangents else f32
    inputs = [
        *(x.astype(bf16) for x in (q, k, v)),
        g.astype(f32),
        beta.astype(f32),
        jnp.asarray(cu_seqlens, jnp.int32),
        *(x.astype(f32) for x in (gamma, *d_decayed)),
        *(x.astype(cotangent) for x in (d_rhs, d_qg, d_kd)),
        *(x.astype(f32) for x in (d_decay, d_beta_kk)),
    ]
    return tokens_bwd_artifact(scale, bf16_cotangents), inputs, results


def tokens_bwd_kernel(scale, tokens, cu_seqlens, rows, gamma, d_decayed, cotangents):
    """xla_tokens_bwd's contract on the kernel (rows: unused, the kernel reads cu_seqlens; q, k
    and v taken as bfloat16, as the sm90 path has them; d_rhs, d_qg, d_kd in their dtype: all
    bf16, or else float32), dq, dk, dv returned in bfloat16 (the float32 sums rounded once:
    what the caller's cast to the tokens' dtype gives)."""
    from jax_kda.sm90.ffi_call import cute_call

    del rows
    q = tokens[0]
    if gamma.shape[0] == 0:  # no slots: no tokens either
        return tokens_bwd_results([jnp.zeros(r.shape, r.dtype) for r in token_grad_results(q)])
    artifact, inputs, results = tokens_bwd_call(
        scale, tokens, cu_seqlens, gamma, d_decayed, cotangents
    )
    return tokens_bwd_results(cute_call(artifact, inputs, results))


def token_grad_results(q):
    """The tokens' backward kernels' results for tokens q [T, H, 128]: dq, dk, dv [T, H, 128]
    bfloat16, dg [T, H, 128] float32 and dbeta's two partial sums [2, T, H] float32."""
    token_shape = (*q.shape[:2], HEAD_DIM)
    results = [jax.ShapeDtypeStruct(token_shape, jnp.bfloat16) for _ in range(3)]
    results.append(jax.ShapeDtypeStruct(token_shape, jnp.float32))
    results.append(jax.ShapeDtypeStruct((2, *q.shape[:2]), jnp.float32))
    return results


def tokens_bwd_results(outputs):
    """(dq, dk, dv, dg, dbeta) from the tokens' backward kernel's outputs: dbeta the sum of its
    two partial sums (one a half of the channels)."""
    dq, dk, dv, dg, dbeta_parts = outputs
    return dq, dk, dv, dg, dbeta_parts[0] + dbeta_parts[1]


@functools.cache
def decayed_tokens_bwd_artifact(scale: float, stamps: bool = False):
    """The exported decayed products' backward with the tokens' backward fused after it
    (kernels/kda_decayed_bwd_sm90.py, DecayedTokensBwdSm90) for this scale: the dense kernel's
    bf16 cotangents; tokens, heads, slots and sequences symbolic. stamps (a diagnostic): the
    variant that also writes each CTA's phase clocks (the kernel module's DECAYED_STAMPS;
    benchmarks/decayed_bwd_phases.py reads them)."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from jax_kda.sm90.export import export, row_major_fake
    from jax_kda.sm90.kernels.kda_decayed_bwd_sm90 import DecayedTokensBwdSm90

    tokens, heads, slots = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    chunk = (slots, heads, SCAN_CHUNK, HEAD_DIM)
    pairs = (slots, heads, SCAN_CHUNK, SCAN_CHUNK)
    token_inputs, token_results = _token_rows_fakes(tokens, heads)
    fakes = {
        **token_inputs,
        "d_kk": row_major_fake(BFloat16, pairs),
        "d_qk": row_major_fake(BFloat16, pairs),
        "d_rhs": row_major_fake(BFloat16, (slots, heads, SCAN_CHUNK, 2 * HEAD_DIM)),
        "d_qg": row_major_fake(BFloat16, chunk),
        "d_kd": row_major_fake(BFloat16, chunk),
        "d_decay": row_major_fake(Float32, (slots, heads, HEAD_DIM)),
        "d_beta_kk": row_major_fake(Float32, (slots, heads, SCAN_CHUNK)),
        **token_results,
    }
    scale_tag = hashlib.sha256(repr(scale).encode()).hexdigest()[:8]
    config = {"scale": repr(scale)}
    if not stamps:
        return export(
            DecayedTokensBwdSm90(scale),
            fakes,
            prefix=f"kda_decayed_tokens_bwd_sm90_{scale_tag}",
            config=config,
        )
    from jax_kda.sm90.kernels.kda_decayed_bwd_sm90 import (
        DECAYED_STAMPS,
        HALVES,
        DecayedTokensBwdStampsSm90,
    )

    stamp_shape = (slots, heads, HALVES, len(DECAYED_STAMPS))
    fakes["stamps"] = row_major_fake(Int32, stamp_shape, align=4)
    return export(
        DecayedTokensBwdStampsSm90(scale),
        fakes,
        prefix=f"kda_decayed_tokens_bwd_sm90_stamps_{scale_tag}",
        config={**config, "stamps": True},
    )


def decayed_tokens_bwd_kernel(scale, tokens, cu_seqlens, rows, d_kk, d_attn, cotangents):
    """decayed_bwd_tokens_kernel, then tokens_bwd_kernel, in one kernel (their contracts
    composed; rows unused): tokens = (q, k, v, g, beta), the cotangents (d_rhs, d_beta_kk, d_qg,
    d_kd, d_decay) and d_kk, d_attn as the dense kernel gives them (taken as bf16). Gamma is no
    input: the kernel sums g as the chunk core does, and gets its gamma bit for bit. Returns
    (dq, dk, dv, dg, dbeta) in the tokens' rows, dq, dk, dv bfloat16."""
    from jax_kda.sm90.ffi_call import cute_call

    del rows
    q, k, v, g, beta = tokens
    if d_kk.shape[0] == 0:  # no slots: no tokens either
        return tokens_bwd_results([jnp.zeros(r.shape, r.dtype) for r in token_grad_results(q)])
    d_rhs, d_beta_kk, d_qg, d_kd, d_decay = cotangents
    f32, bf16 = jnp.float32, jnp.bfloat16
    if any(x.dtype != bf16 for x in (d_kk, d_attn, d_rhs, d_qg, d_kd)):
        raise TypeError(
            "decayed_tokens_bwd_kernel takes the dense kernel's bfloat16 d_kk, d_attn, d_rhs, "
            "d_qg and d_kd (float32 ones run decayed_bwd_tokens_kernel, then tokens_bwd_kernel)"
        )
    results = token_grad_results(q)
    inputs = [
        *(x.astype(bf16) for x in (q, k, v)),
        g.astype(f32),
        beta.astype(f32),
        jnp.asarray(cu_seqlens, jnp.int32),
        *(x.astype(bf16) for x in (d_kk, d_attn, d_rhs, d_qg, d_kd)),
        *(x.astype(f32) for x in (d_decay, d_beta_kk)),
    ]
    out = cute_call(decayed_tokens_bwd_artifact(scale), inputs, results)
    return tokens_bwd_results(out)


def decayed_tokens_bwd_stamps(scale, tokens, cu_seqlens, d_kk, d_attn, cotangents):
    """A diagnostic: the fused decayed and tokens' backward's stamps variant on these inputs
    (decayed_tokens_bwd_kernel's, all of them given), returning
    only each (slot, head, half) CTA's clocks, int32 [slots, H, 2, len(DECAYED_STAMPS)] (the
    kernel module's DECAYED_STAMPS says what each holds)."""
    from jax_kda.sm90.ffi_call import cute_call
    from jax_kda.sm90.kernels.kda_decayed_bwd_sm90 import DECAYED_STAMPS, HALVES

    q, k, v, g, beta = tokens
    d_rhs, d_beta_kk, d_qg, d_kd, d_decay = cotangents
    if d_kk.shape[0] == 0:
        raise ValueError("decayed_tokens_bwd_stamps: wants chunk slots")
    f32, bf16 = jnp.float32, jnp.bfloat16
    stamp_shape = (*d_kk.shape[:2], HALVES, len(DECAYED_STAMPS))
    results = [*token_grad_results(q), jax.ShapeDtypeStruct(stamp_shape, jnp.int32)]
    inputs = [
        *(x.astype(bf16) for x in (q, k, v)),
        g.astype(f32),
        beta.astype(f32),
        jnp.asarray(cu_seqlens, jnp.int32),
        *(x.astype(bf16) for x in (d_kk, d_attn, d_rhs, d_qg, d_kd)),
        *(x.astype(f32) for x in (d_decay, d_beta_kk)),
    ]
    artifact = decayed_tokens_bwd_artifact(scale, True)
    return cute_call(artifact, inputs, results)[-1]


def xla_chunk_core(q, k, v, g, beta, cu_seqlens, num_slots, scale):
    """chunk_core_kernel's contract in XLA (the XLA path's operands and T^-1; gates below
    constants.GATE_FLOOR taken as it, as the kernel does): the stand-in of CPU tests and of
    benchmarks.precision_study."""
    _, rows = xla._token_slots(cu_seqlens, q.shape[0])
    g = jnp.maximum(g, GATE_FLOOR)
    chunks = [xla._to_chunks(x.astype(jnp.float32), rows, num_slots) for x in (q, k, v, g, beta)]
    outputs, residuals = xla._chunk_operands_with_residuals(*chunks, scale)
    gamma, kk, lower = residuals[4], residuals[5], residuals[6]
    identity = jnp.broadcast_to(jnp.eye(lower.shape[-1], dtype=lower.dtype), lower.shape)
    return (*outputs, gamma, kk, xla._blocked_unit_lower_solve(lower, identity))


def differentiable_chunk_operands(run, decayed_bwd=None, precision=jax.lax.Precision.HIGHEST):
    """xla.chunk_operands's contract from `run` (chunk_core_kernel, or a stand-in in CPU tests),
    with xla._chunk_operands_bwd (written out, parallel over chunks) as its backward; its
    decayed products' part by `decayed_bwd` (decayed_bwd_kernel) where given, else in XLA;
    `precision` that of its dense products (with the chunk core's T^-1, the solve's too)."""

    def float_outputs(*args):
        # xla.chunk_operands's (w, u, qg, attn, kd, decay) as float32 values, and the rest
        outputs = run(*args)
        return (*(chunk_rows(x) for x in outputs[:5]), outputs[5]), outputs[6:]

    @functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
    def operands(q, k, v, g, beta, cu_seqlens, rows, num_slots, scale):
        return float_outputs(q, k, v, g, beta, cu_seqlens, num_slots, scale)[0]

    def operands_fwd(q, k, v, g, beta, cu_seqlens, rows, num_slots, scale):
        outputs, rest = float_outputs(q, k, v, g, beta, cu_seqlens, num_slots, scale)
        w, u = outputs[:2]
        gamma, kk, t_inverse = rest[0], rest[1], chunk_rows(rest[2])
        like = tuple(jnp.zeros((0,), x.dtype) for x in (q, k, v, g, beta))  # the dtypes
        # What xla._chunk_operands_bwd needs: the chunked inputs and the kernel's intermediates.
        f32 = jnp.float32
        q_c, k_c, v_c, beta_c = (
            xla._to_chunks(x.astype(f32), rows, num_slots) for x in (q, k, v, beta)
        )
        strict = jnp.arange(SCAN_CHUNK)[:, None] > jnp.arange(SCAN_CHUNK)[None, :]
        lower = jnp.where(strict, beta_c[..., :, None] * kk, 0.0)
        solved = jnp.concatenate([w, u], axis=-1)
        residuals = (q_c, k_c, v_c, beta_c, gamma, kk, lower, solved)
        return outputs, (residuals, t_inverse, rows, like)

    def operands_bwd(num_slots, scale, saved, cotangents):
        residuals, t_inverse, rows, like = saved
        d_chunked = xla._chunk_operands_bwd(
            scale, residuals, cotangents, decayed_bwd=decayed_bwd, t_inverse=t_inverse,
            precision=precision,
        )  # fmt: skip
        d_tokens = [
            xla.from_chunks(d, rows).astype(x.dtype) for d, x in zip(d_chunked, like, strict=True)
        ]
        return (*d_tokens, None, None)

    operands.defvjp(operands_fwd, operands_bwd)
    return operands


SAVED_TOKENS = 5  # q, k, v, g, beta: the first of training_residual_forward's saved arrays


def training_residual_forward(q, k, v, g, beta, cu_seqlens, initial_state, scale):
    """(o, final_state, saved): training_forward's forward (the chunk core, the forward state
    scan, the outputs; every kernel at its default) together with what its backward takes, so
    that training_residual_backward recomputes nothing: `saved` is a tuple of arrays, the
    packed tokens, cu_seqlens, the tokens' slot rows, the chunk core's outputs (gamma None: the
    fused backward sums g itself) and the chunk states, in that order
    (plan_prefill(...).saved_residual_bytes their size)."""
    chunks = _training_chunks(q.shape[1], cu_seqlens.shape[0] - 1, both_scans=False)
    total_tokens, num_sequences = q.shape[0], cu_seqlens.shape[0] - 1
    num_slots = xla.chunk_slot_count(total_tokens, num_sequences)
    cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
    _, rows = xla._token_slots(cu_seqlens, total_tokens)
    state_kv = jnp.swapaxes(initial_state.astype(jnp.float32), -1, -2)
    (o, finals), saved = chunks.fwd(q, k, v, g, beta, cu_seqlens, rows, state_kv, num_slots, scale)
    tokens, cu_saved, rows_saved, core_out, states, _like = saved
    flat = (*tokens, cu_saved, rows_saved, *core_out, states)
    return o.astype(q.dtype), jnp.swapaxes(finals, -1, -2), flat


def training_residual_backward(saved, d_o, d_final, scale):
    """The gradients (dq, dk, dv, dg, dbeta, d_initial_state) of training_residual_forward's
    call from its `saved` arrays and the cotangents of o [T, H, V] and the final state
    [N, H, V, K]: the backward of training_forward without its recompute (the chunk core and
    the forward scan ran in the forward). Gradients in the tokens' dtypes, d_initial_state
    float32."""
    tokens = tuple(saved[:SAVED_TOKENS])
    cu_seqlens, rows = saved[SAVED_TOKENS : SAVED_TOKENS + 2]
    core_out, states = tuple(saved[SAVED_TOKENS + 2 : -1]), saved[-1]
    chunks = _training_chunks(tokens[0].shape[1], cu_seqlens.shape[0] - 1, both_scans=False)
    like = tuple(jnp.zeros((0,), x.dtype) for x in tokens)
    num_slots = core_out[0].shape[0]
    cotangents = (d_o.astype(jnp.float32), jnp.swapaxes(d_final.astype(jnp.float32), -1, -2))
    residuals = (tokens, cu_seqlens, rows, core_out, states, like)
    *d_tokens, _, _, d_y0 = chunks.bwd(num_slots, scale, residuals, cotangents)
    return (*d_tokens, jnp.swapaxes(d_y0, -1, -2))


FUSE_ADDEND = False
"""Whether the training backward's reverse scan forms its addend itself
(reverse_scan_addend_kernel's one launch, where its CTAs have an SM each) instead of reading
the state cotangent kernel's. Off: on the H100 (2026-12-07,
benchmarks/results/2026-12-07-h100-e-*-reverse-addend.log) its g_end and d_y0 equal the two
kernels' bit for bit, but it saves nothing: 51.5 us against 31.8 + 17.2 at 2048x12x1, 193.3
against 127.8 + 70.5 at 8192x16x1. The chain waits for the addend every step: the addend
warpgroup's per-chunk work (Qg's and Aqk's layout into images, three products, dO's rows)
takes longer than a step of the chain (about 1 us at 2048x12x1). Taking the layout off the
chain's path does not change that: with chunk j + 1's Qg and Aqk laid out into a second image
pair while chunk j's products run (branch next-addend-overlap, as the forward's outputs
warpgroup does; H100, 2026-12-07, results/2026-12-07-h100-k-profile-variants-addend-overlap-*,
bit for bit the two kernels in its GPU test) the one launch took 53.0-53.2 us against 30.9-31.3
+ 16.9-17.0, and 201.2-201.3 against 124.8-125.2 + 70.7-70.9 at 8192x16x1: the three products
a chunk on one warpgroup are the bound."""

DENSE_PRECISIONS = {
    "bf16": jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
    "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "float32": jax.lax.Precision.HIGHEST,
}
"""training_forward's dense_precision choices and the dot precisions they stand for."""


def _training_chunks(
    num_heads, num_sequences, *, both_scans, chunk_core=True, decayed_bwd=True,
    scan_v_slice=None, scan_tensor_cores=None, dense_precision="bf16", chunk_core_passes=1,
    scan_passes=None, tokens_bwd=True, fuse_tokens=True, fuse_outputs=True,
    scan_plain_addend=True, outputs_warpgroup=True, outputs_images=False,
    bf16_states=None, bf16_addend=None, fuse_addend=None,
):  # fmt: skip
    """training_forward's differentiable_chunks for these switches (its dense_bwd=True form);
    the defaults are the training path's kernels, which training_residual_forward and
    training_residual_backward run too. bf16_states, bf16_addend: None takes BF16_STATES and
    BF16_ADDEND where the products are single-pass (dense_precision "bf16", scan_passes None
    or 1), float32 elsewhere; True there is refused."""
    # the bf16 arrays serve the single-pass products only (the dense kernel's, the scans' at
    # one pass); where a caller asks for more precision they stay float32
    single = dense_precision == "bf16" and scan_passes in (None, 1)
    if (bf16_states or bf16_addend) and not single:
        raise ValueError(
            'bf16_states and bf16_addend need dense_precision="bf16" and the state scans at '
            f"one pass (scan_passes None or 1), got {dense_precision!r} and {scan_passes!r}"
        )
    if bf16_states is None:
        bf16_states = BF16_STATES and single
    if bf16_addend is None:
        bf16_addend = BF16_ADDEND and single
    if fuse_addend and (not single or both_scans):
        raise ValueError(
            'fuse_addend needs the single-pass products (dense_precision="bf16", scan_passes '
            "None or 1) and the saved chunk states (both_scans=False): the one launch is the "
            "reverse scan alone"
        )
    if fuse_addend is None:
        fuse_addend = FUSE_ADDEND and single and not both_scans
    precision = DENSE_PRECISIONS[dense_precision]
    bwd_v_slice = scan_v_slice
    if both_scans and scan_v_slice is None and scan_tensor_cores is not False:
        # the backward's scans (and the addend the state cotangent writes for them) take the
        # width that suits both directions in one launch
        bwd_v_slice, _ = scan_variant(num_heads, num_sequences, both_directions=True)
    # the dense kernel's bf16 cotangents: the decayed and tokens' backward in one kernel, which
    # sums g into Gamma itself (the chunk core then stores none)
    fused = decayed_bwd and tokens_bwd and fuse_tokens and dense_precision == "bf16"
    chunk_bwd = functools.partial(
        xla_chunk_bwd,
        dense_bwd=dense_bwd_kernel if dense_precision == "bf16" else None,
        decayed_bwd=decayed_bwd_tokens_kernel if decayed_bwd else None,
        tokens_bwd=tokens_bwd_kernel if tokens_bwd else None,
        decayed_tokens_bwd=decayed_tokens_bwd_kernel if fused else None,
    )
    core = functools.partial(chunk_core_kernel, passes=chunk_core_passes, keep_gamma=not fused)
    primal_core = functools.partial(chunk_core_kernel, passes=chunk_core_passes, residuals=False)
    return differentiable_chunks(
        core if chunk_core else xla_chunk_core,
        functools.partial(
            state_scan_kernel, v_slice=scan_v_slice, tensor_cores=scan_tensor_cores,
            passes=scan_passes, plain_addend=scan_plain_addend, bf16_states=bf16_states,
        ),
        chunk_bwd,
        precision,
        state_cotangent=functools.partial(
            state_cotangent_kernel, scan_v_slice=bwd_v_slice, scan_tensor_cores=scan_tensor_cores,
            bf16=bf16_addend,
        ) if dense_precision == "bf16" else None,
        chunk_outputs=chunk_outputs_kernel if dense_precision == "bf16" else None,
        both_scans=functools.partial(
            state_scans_kernel, v_slice=bwd_v_slice, tensor_cores=scan_tensor_cores,
            passes=scan_passes, plain_addend=scan_plain_addend, bf16_states=bf16_states,
        ) if both_scans else None,
        primal_core=primal_core if chunk_core else None,
        # the reverse scan forming its addend itself where its CTAs have an SM each
        reverse_addend=functools.partial(
            reverse_scan_addend_kernel, v_slice=bwd_v_slice, tensor_cores=scan_tensor_cores,
            passes=scan_passes, bf16_addend=bf16_addend,
        ) if fuse_addend else None,
        # the forward scan and the outputs in one launch (the outputs kernel's bf16 products)
        scan_outputs=functools.partial(
            state_scan_outputs_kernel, v_slice=scan_v_slice, tensor_cores=scan_tensor_cores,
            passes=scan_passes, outputs_warpgroup=outputs_warpgroup,
            plain_addend=scan_plain_addend, bf16_states=bf16_states,
        ) if fuse_outputs and dense_precision == "bf16" else None,
        # a call that is not differentiated: Qg and Aqk from the chunk core as the one
        # launch's images, where it runs
        primal_images=functools.partial(
            scan_outputs_fused, v_slice=scan_v_slice, tensor_cores=scan_tensor_cores,
            passes=scan_passes,
        ) if (
            outputs_images and fuse_outputs and outputs_warpgroup and chunk_core
            and chunk_core_passes == 1 and dense_precision == "bf16"
        ) else None,
    )  # fmt: skip


IN_KERNEL_PREP = True
"""Whether prefill runs a call that is not differentiated with its use_*_in_kernel
preparations in the kernels as they load the inputs (jax_kda/api.py's route): with a gate
bound (the safe gate's included) in the gate-bound forward's PREP (forward's prep), without
one in the chunk core (prepared_forward); for every combination (IN_KERNEL_PREPS). False takes
the XLA preparation before the plain kernels for every call (a diagnostic)."""

IN_KERNEL_PREPS = frozenset(
    (norm, gate, logits, grouped)
    for norm in (False, True)
    for gate in (False, True)
    for logits in (False, True)
    for grouped in (False, True)
    if norm or gate or logits or grouped
)
"""The preparations (qk_l2norm, gate, beta_logits, grouped_qk) prefill does in the kernels:
every combination, each of whose kernels passed its GPU tests on both forwards (H100,
2026-12-07: test_gate_bound_forward_prepares_every_combination and
test_chunk_core_prepares_every_combination, 38 cases against the plain kernels on
XLA-prepared inputs, rms_ratio at most 2.7e-4, and the float64 oracle, o at most 4.1e-3;
results/2026-12-07-h100-b-tests-preparations.log).
In the kernels they cost less than in XLA (benchmarks/prep_cost.py, H100, GPU time a call,
fla's three flags: the softplus gate 114.1 against 124.1 us at 2048x12x1 and 454.7 against
528.2 at 8192x16x1; the safe gate 133.4 against 138.3, 450.6 against 475.4, and 23.3 against
39.5 at 33x2x3-ragged)."""


def in_kernel_prep(qk_l2norm, gate, beta_logits, grouped_qk) -> bool:
    """Whether prefill prepares these inputs in the kernels (IN_KERNEL_PREP, IN_KERNEL_PREPS)."""
    return IN_KERNEL_PREP and (qk_l2norm, gate, beta_logits, grouped_qk) in IN_KERNEL_PREPS


def prepared_forward(
    q, k, v, g, beta, cu_seqlens, initial_state, scale, *, qk_l2norm=False, gate=False,
    lower_bound=None, beta_logits=False, a_log=None, dt_bias=None, grouped_qk=False,
):  # fmt: skip
    """The no-bound forward of a call that is not differentiated (training_forward's kernels
    at their defaults: the forward-alone chunk core and the scan that writes o), with the
    inputs prepared in the chunk core as they load, so that no prepared copy of them goes
    through HBM: q and k raw where qk_l2norm, g the raw gate projection a where gate (with
    a_log [HV] and dt_bias [HV, 128] or [HV * 128], None for fla's defaults; lower_bound None:
    the softplus gate, else the safe one), beta logits where beta_logits, q and k with H
    heads against the rest's HV = G H where grouped_qk (jax_kda/gate.py states each
    preparation; the kernels' InputPrep). No VJP of its own: prefill differentiates the XLA
    preparation and the plain kernels instead (IN_KERNEL_PREP)."""
    from jax_kda.sm90.kernels.input_prep import InputPrep

    prep = InputPrep(
        qk_l2norm=qk_l2norm,
        gate=gate,
        lower_bound=lower_bound,
        beta_logits=beta_logits,
        grouped_qk=grouped_qk,
    )
    chunks = _training_chunks(v.shape[1], cu_seqlens.shape[0] - 1, both_scans=True)
    core = functools.partial(
        chunk_core_kernel, passes=1, residuals=False, prep=prep, a_log=a_log, dt_bias=dt_bias
    )

    def undifferentiated(*args):
        return chunks.primal_forward(*args, run_core=core)[0]

    return xla.forward(q, k, v, g, beta, cu_seqlens, initial_state, scale, chunks=undifferentiated)


def training_forward(
    q, k, v, g, beta, cu_seqlens, initial_state, scale, *, chunk_core=True, decayed_bwd=True,
    scan_v_slice=None, scan_tensor_cores=None, dense_precision="bf16", chunk_core_passes=1,
    scan_passes=None, dense_bwd=True, tokens_bwd=None, both_scans=True, fuse_tokens=True,
    fuse_outputs=True, scan_plain_addend=True, outputs_warpgroup=True, outputs_images=False,
    bf16_states=None, bf16_addend=None, fuse_addend=None,
):  # fmt: skip
    """The forward the sm90 backward differentiates (and the no-bound forward), exact for any
    g <= 0: the chunk-core kernel's per-chunk operands (their backward written out,
    xla._chunk_operands_bwd, with its decayed products on their kernel) around the state-scan
    kernel, whose backward is the reverse scan, and the dense products around the scan.

    Precision: the dense products, the chunk core's and the state scan's take one bf16
    tensor-core pass with float32 accumulation by default (operands rounded to about 2^-9);
    dense_precision="bf16x3" and chunk_core_passes=3 / scan_passes=3 take three
    (A_hi B_hi + A_lo B_hi + A_hi B_lo, about 2^-16 relative, three times the tensor-core work,
    twice the operand images), dense_precision="float32" runs the dense products at HIGHEST.
    scan_passes=None: one on the tensor-core scan, and float32 where the plan or
    scan_tensor_cores picks a SIMT scan (which has no bf16 passes to choose). Whatever the
    passes, the chunk-core kernel stores W, U, Qg, Aqk, Kd and T^-1 in bfloat16 (its
    consumers' operand precision at one pass): the three-pass choices make the products
    themselves about float32-accurate, not what flows between the kernels (a three-pass scan
    then splits W and Kd whose low parts are zero), and the dense kernel (dense_precision
    "bf16") stores its outputs in bf16 too; at "bf16x3" or "float32" the XLA dense backward's
    float32 outputs reach the decayed and tokens kernels unrounded (their float32 variants).
    The decayed products' backward keeps three passes: with one, dg missed the float64 oracle
    on production data (rms_ratio 2.4e-2 at [300, 0, 77, 130], 4.9e-2 at 16384 tokens, H200):
    dg there is a small difference of large terms. One pass with the diagonal blocks pair by
    pair in float32 (branch wip/dbwd1) meets the bar (dg 3.4e-3 at 4096 tokens, H200) but the
    kernel then takes 283 against 134 us at 2048x12x1: the pairs run on the SIMT cores.

    The other switches are for profiling (benchmarks.kernel_profile --train-variants) and
    tests: chunk_core=False takes the operands from the XLA path's code, decayed_bwd=False
    their backward's decayed products too; scan_v_slice and scan_tensor_cores pick the
    state-scan variant (None: the plan's). dense_bwd=True (the default) takes the chunk core,
    the state scan and the outputs around it as one custom VJP (differentiable_chunks) whose
    backward runs the reverse scan, then every product touching a chunk's state and the chunk
    core's solve backward in one kernel (dense_bwd_kernel; xla_dense_bwd at dense_precision
    other than bf16; the reverse scan's addend likewise on state_cotangent_kernel, and the
    forward's outputs on chunk_outputs_kernel), then the decayed products' backward, then
    (tokens_bwd=True; None: as dense_bwd) the element-wise rest straight into the tokens'
    rows on tokens_bwd_kernel (False: in XLA, xla_tokens_bwd); with the dense kernel's bf16
    cotangents and both kernels on, the two run as one, decayed_tokens_bwd_kernel (fuse_tokens;
    False: one after the other). fuse_outputs=True (with dense_bwd, where the outputs kernel
    would run): the forward scan writes the outputs itself where plan.scan_outputs_v_slice says
    so, state_scan_outputs_kernel (on tensor cores at one pass; elsewhere it runs the two
    kernels). outputs_warpgroup=True (with fuse_outputs): that kernel's variant whose O
    products and stores run on a second warpgroup, off the serial chain.
    scan_plain_addend=True (with dense_bwd): the forward scans (the forward's, and the
    backward's recompute beside the reverse one) read the chunk core's bf16 U as it is
    (state_scan_kernel's plain_addend). All three are on by default since they passed their
    GPU tests (H100, 2026-12-06: benchmarks/results/2026-12-06-h100-tests-opt-in-*.log); with
    them a forward that is not differentiated is two launches, the chunk core and the scan
    with the outputs. H100 kernel_profile (2026-12-06-h100-profile-forward.log), the forward
    alone, off -> fuse_outputs + scan_plain_addend -> all three: 2048x12x1 116.2 -> 108.4 ->
    100.7 us, 8192x16x1 512.8 -> 453.5 -> 437.8, 1024x4x1 44.1 -> 46.3 -> 42.6,
    33x2x3-ragged 27.7 -> 22.2 -> 19.8; recompute + backward
    (2026-12-06-h100-profile-train.log) 317.9 / 1440.5 / 102.5 / 68.3 us off, 310.3 / 1408.5 /
    97.1 / 61.7 with all three.
    outputs_images=True (with fuse_outputs and outputs_warpgroup): a call that is not
    differentiated, where the one launch runs, has the chunk core write Qg and Aqk as that
    launch's operand images (chunk_core_kernel(images=True)), which its outputs' warpgroup
    then copies in as they are instead of laying them out a chunk at a time; off by default:
    bit for bit the plain variants' on an H100 (2026-12-06), but only 1-2% faster on large
    shapes and slightly slower on small ones.
    both_scans=True (with dense_bwd): the backward runs the chunk states' scan again beside the
    reverse scan, in one launch (state_scans_kernel), instead of saving the states from the
    forward's scan. bf16_states and bf16_addend (with dense_bwd; None: BF16_STATES and
    BF16_ADDEND at dense_precision "bf16" with single-pass scans, off otherwise, True refused
    there): the chunk states, and the reverse scan's addend, stored in bf16. fuse_addend (with
    dense_bwd, without both_scans; None: FUSE_ADDEND): the reverse scan forms its addend on
    a warpgroup of its own (reverse_scan_addend_kernel) where its CTAs have an SM each.
    H200 profile, recompute + backward at 2048x12x1 / 8192x16x1: 769 / 3420 us without
    dense_bwd, 688 / 2989 with it, 613 / 2776 with the state-cotangent and tokens kernels,
    594.5 / 2606 with the outputs', 493.9 / 2144.0 with the kernels reading the tokens' rows
    and the decayed kernel's vector loads and trimmed image builds, 466.7 / 1984.9 with the
    scan's operands written in its layouts by the kernels and the gate floor applied in them;
    the gradients alone (the recompute's outputs dead, as in a gate-bound step): 434.8 /
    1869.3, and 426.0 / 1832.0 with both_scans.
    An earlier variant fused the element-wise rest into the decayed products' kernel instead:
    exact, but slower than XLA (2048x12x1 969 against 944 us): at that kernel's one CTA an SM
    the memory-bound tail was latency-bound; tokens_bwd_kernel runs it at two CTAs an SM of
    16 warps each, with nothing else in shared memory. decayed_tokens_bwd_kernel fuses only
    the element-wise rest, at the decayed kernel's two CTAs an SM since it took half the
    channels a CTA (H200, kernel_profile --train: the two kernels' 113.8 / 569.6 us to 100.6 /
    481.5)."""
    if decayed_bwd and not chunk_core:
        raise ValueError("decayed_bwd=True needs chunk_core=True (the operands' backward it is in)")
    if tokens_bwd is None:
        tokens_bwd = dense_bwd
    if outputs_warpgroup and not fuse_outputs:
        raise ValueError("outputs_warpgroup=True needs fuse_outputs=True (the kernel it picks)")
    if outputs_images and not outputs_warpgroup:
        raise ValueError("outputs_images=True needs outputs_warpgroup=True (the kernel it feeds)")
    if outputs_images and not (
        dense_bwd and chunk_core and chunk_core_passes == 1 and dense_precision == "bf16"
    ):
        raise ValueError(
            "outputs_images=True needs the chunk-core kernel at one pass, dense_bwd=True and "
            'dense_precision="bf16" (the forward it changes)'
        )
    if tokens_bwd and not dense_bwd:
        raise ValueError("tokens_bwd=True needs dense_bwd=True (the backward it ends)")
    if dense_precision not in DENSE_PRECISIONS:
        raise ValueError(
            f"dense_precision is one of {sorted(DENSE_PRECISIONS)}, not {dense_precision!r}"
        )
    precision = DENSE_PRECISIONS[dense_precision]
    if dense_bwd:
        chunks = _training_chunks(
            q.shape[1], cu_seqlens.shape[0] - 1, both_scans=both_scans, chunk_core=chunk_core,
            decayed_bwd=decayed_bwd, scan_v_slice=scan_v_slice,
            scan_tensor_cores=scan_tensor_cores, dense_precision=dense_precision,
            chunk_core_passes=chunk_core_passes, scan_passes=scan_passes, tokens_bwd=tokens_bwd,
            fuse_tokens=fuse_tokens, fuse_outputs=fuse_outputs,
            scan_plain_addend=scan_plain_addend, outputs_warpgroup=outputs_warpgroup,
            outputs_images=outputs_images, bf16_states=bf16_states, bf16_addend=bf16_addend,
            fuse_addend=fuse_addend,
        )  # fmt: skip
        return xla.forward(
            q, k, v, g, beta, cu_seqlens, initial_state, scale, precision=precision,
            chunks=chunks,
        )  # fmt: skip
    kernel = functools.partial(
        state_scan_kernel, v_slice=scan_v_slice, tensor_cores=scan_tensor_cores,
        passes=scan_passes,
    )  # fmt: skip
    core = functools.partial(chunk_core_kernel, passes=chunk_core_passes)
    scan = differentiable_state_scan(kernel, precision)
    if chunk_core:
        operands = differentiable_chunk_operands(
            core,
            decayed_bwd_kernel if decayed_bwd else None,
            precision,
        )
        return xla.forward(
            q, k, v, g, beta, cu_seqlens, initial_state, scale, scan=scan, operands=operands,
            precision=precision,
        )  # fmt: skip
    return xla.forward(
        q, k, v, g, beta, cu_seqlens, initial_state, scale, scan=scan, precision=precision
    )


@functools.cache
def decode_artifact(scale: float, pooled: bool):
    """The exported decode step (kernels/kda_decode_sm90.py) for this scale, on a dense state
    [N, HV, 128, 128] or (pooled) a pool [P, HV, 128, 128] read and written at indices [N];
    N, H, HV and P symbolic."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from jax_kda.sm90.export import export, row_major_fake
    from jax_kda.sm90.kernels.kda_decode_sm90 import DecodeConfig, DecodeSm90

    n, heads, value_heads = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    rows = cute.sym_int32() if pooled else n
    token = (n, value_heads, HEAD_DIM)
    fakes = {
        "q": row_major_fake(BFloat16, (n, heads, HEAD_DIM), align=16),
        "k": row_major_fake(BFloat16, (n, heads, HEAD_DIM), align=16),
        "v": row_major_fake(BFloat16, token),
        "g": row_major_fake(Float32, token),
        "beta": row_major_fake(Float32, (n, value_heads), align=4),
        "indices": row_major_fake(Int32, (cute.sym_int32(),), align=4),
        "state": row_major_fake(Float32, (rows, value_heads, HEAD_DIM, HEAD_DIM)),
        "o": row_major_fake(BFloat16, token),
    }
    scale_tag = hashlib.sha256(repr(scale).encode()).hexdigest()[:8]
    return export(
        DecodeSm90(DecodeConfig(scale=scale, pooled=pooled)),
        fakes,
        prefix=f"kda_decode_sm90{'_pool' if pooled else ''}_{scale_tag}",
        config={"scale": repr(scale), "pooled": pooled},
    )


def decode_unavailable_reason(q_dtype, num_sequences, state_shape) -> str | None:
    """Why the decode kernel cannot serve a step of num_sequences tokens here (state_shape: the
    state's or the pool's [N or P, HV, 128, 128]), or None if it can."""
    if jnp.dtype(q_dtype) != jnp.bfloat16:
        return f"the decode kernel takes bfloat16 q, k, v; got {jnp.dtype(q_dtype)}"
    if (reason := _device_reason()) is not None:
        return reason
    sizes = (num_sequences, *state_shape)
    if not all(isinstance(d, (int, np.integer)) for d in sizes):
        return (
            f"N={num_sequences} or the state's shape {tuple(state_shape)} is symbolic: export "
            "with backend='xla'"
        )
    value_heads = state_shape[1]
    elements = {
        "state": math.prod(state_shape),
        "v": num_sequences * value_heads * HEAD_DIM,
        "grid": DECODE_CTAS_PER_HEAD * num_sequences,
    }
    too_big = {name: size for name, size in elements.items() if size >= INDEX_LIMIT}
    if too_big:
        return (
            f"N={num_sequences} with a state of {tuple(state_shape)} needs {too_big}, beyond the "
            f"kernel's 32-bit indexing (< {INDEX_LIMIT}); split the call"
        )
    if value_heads > GRID_YZ_LIMIT:
        return f"HV={value_heads} passes CUDA's grid extent {GRID_YZ_LIMIT}; split the call"
    return _toolchain_reason()


def decode_kernel(q, k, v, g, beta, state, scale, state_indices=None):
    """One decode step on the kernel: (o [N, HV, 128] bfloat16, the new state or pool), the
    state's buffer updated in place (the call aliases it to its result: donate it, or XLA
    copies it first). q, k, v bfloat16; g, beta and the state float32; state_indices None
    (the state is [N, HV, 128, 128]) or [N] int32 into a pool."""
    from jax_kda.sm90.ffi_call import cute_call

    pooled = state_indices is not None
    if any(x.dtype != jnp.bfloat16 for x in (q, k, v)):
        raise TypeError(f"the decode kernel takes bfloat16 q, k, v; got {q.dtype}")
    if v.shape[0] == 0:  # no sequences: nothing to launch (an empty grid)
        return jnp.zeros(v.shape, jnp.bfloat16), state
    indices = state_indices if pooled else jnp.zeros((1,), jnp.int32)
    o_shape = jax.ShapeDtypeStruct(v.shape, jnp.bfloat16)
    state_shape = jax.ShapeDtypeStruct(state.shape, jnp.float32)
    inputs = [q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32),
              jnp.asarray(indices, jnp.int32), state.astype(jnp.float32)]  # fmt: skip
    new_state, o = cute_call(decode_artifact(scale, pooled), inputs, [state_shape, o_shape],
                             aliases={6: 0})  # fmt: skip
    return o, new_state
