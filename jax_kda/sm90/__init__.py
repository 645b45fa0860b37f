"""The sm90 (Hopper) backend: CuTe DSL kernels exported ahead of time and called from jax.jit
through one XLA FFI target.

    backend.py    availability, kernel export per variant, the calls (forward, training forward)
    plan.py       static plan of a call (segments, launches, workspace), plain Python
    export.py     compile + export_to_c for sm_90a with symbolic sizes, the disk cache
    ffi_build.py  builds the FFI handler (cute_call.cc, shipped with the package) on first use
    ffi_call.py   registers the FFI target and wraps jax.ffi.ffi_call
    kernels/      the CuTe DSL kernels, one a file, and layout.py, their layout facts
"""

import os

# The DSL reads its target architecture once, when cutlass is first imported: set Hopper's here,
# before any kernel module can import it (without a GPU the DSL would take its own default, and
# every kernel would refuse to build). An architecture the caller set is kept.
if not os.environ.get("CUTE_DSL_ARCH"):
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"

from jax_kda.sm90 import backend
from jax_kda.sm90.backend import (
    ASSUME_SM90_ENV,
    INDEX_LIMIT,
    SM_COUNT_ENV,
    SlicedAddend,
    chunk_core_kernel,
    chunk_operands_artifact,
    chunk_outputs_artifact,
    chunk_outputs_kernel,
    decayed_bwd_artifact,
    decayed_bwd_kernel,
    decayed_bwd_tokens_kernel,
    decode_artifact,
    decode_kernel,
    decode_unavailable_reason,
    dense_bwd_artifact,
    dense_bwd_kernel,
    device_sm_count,
    differentiable_chunk_operands,
    differentiable_chunks,
    differentiable_state_scan,
    forward,
    forward_artifact,
    has_hopper,
    result_shapes,
    scan_unavailable_reason,
    state_cotangent_artifact,
    state_cotangent_kernel,
    state_scan_artifact,
    state_scan_kernel,
    state_scan_operands,
    state_scans_artifact,
    state_scans_kernel,
    tokens_bwd_artifact,
    tokens_bwd_call,
    tokens_bwd_kernel,
    tokens_bwd_results,
    training_forward,
    training_residual_backward,
    training_residual_forward,
    unavailable_reason,
    xla_chunk_bwd,
    xla_chunk_core,
    xla_chunk_outputs,
    xla_decayed_bwd_tokens,
    xla_dense_bwd,
    xla_dense_products_bwd,
    xla_state_cotangent,
    xla_tokens_bwd,
)

__all__ = [
    "ASSUME_SM90_ENV",
    "INDEX_LIMIT",
    "SM_COUNT_ENV",
    "SlicedAddend",
    "backend",
    "chunk_core_kernel",
    "chunk_operands_artifact",
    "chunk_outputs_artifact",
    "chunk_outputs_kernel",
    "decayed_bwd_artifact",
    "decayed_bwd_kernel",
    "decayed_bwd_tokens_kernel",
    "decode_artifact",
    "decode_kernel",
    "decode_unavailable_reason",
    "dense_bwd_artifact",
    "dense_bwd_kernel",
    "device_sm_count",
    "differentiable_chunk_operands",
    "differentiable_chunks",
    "differentiable_state_scan",
    "forward",
    "forward_artifact",
    "has_hopper",
    "result_shapes",
    "scan_unavailable_reason",
    "state_cotangent_artifact",
    "state_cotangent_kernel",
    "state_scan_artifact",
    "state_scan_kernel",
    "state_scan_operands",
    "state_scans_artifact",
    "state_scans_kernel",
    "tokens_bwd_artifact",
    "tokens_bwd_call",
    "tokens_bwd_kernel",
    "tokens_bwd_results",
    "training_forward",
    "training_residual_backward",
    "training_residual_forward",
    "unavailable_reason",
    "xla_chunk_bwd",
    "xla_chunk_core",
    "xla_chunk_outputs",
    "xla_decayed_bwd_tokens",
    "xla_dense_bwd",
    "xla_dense_products_bwd",
    "xla_state_cotangent",
    "xla_tokens_bwd",
]
