"""jax_kda: Kimi Delta Attention (KDA) prefill for JAX.

``jax_kda.prefill`` runs CuTe DSL sm90 kernels through the XLA FFI on Hopper and a pure-XLA
chunked implementation everywhere else; see its docstring for the contract. ``jax_kda.decode``
is the one-token step for serving, on the same state layout. ``jax_kda.nn`` (with the ``nn``
extra: flax) has the Flax NNX layer, ``KimiDeltaAttention``.
"""

from jax_kda import parallel
from jax_kda.api import BACKENDS, BackendUnavailableError, prefill
from jax_kda.checks import check_cu_seqlens
from jax_kda.constants import HEAD_DIM
from jax_kda.decode_step import decode
from jax_kda.gate import kda_gate, l2_normalize, safe_gate
from jax_kda.sm90.kernels.layout import CHUNK
from jax_kda.sm90.plan import PrefillPlan, WorkspaceBuffer, plan_prefill

__all__ = [
    "BACKENDS",
    "CHUNK",
    "HEAD_DIM",
    "BackendUnavailableError",
    "PrefillPlan",
    "WorkspaceBuffer",
    "check_cu_seqlens",
    "decode",
    "kda_gate",
    "l2_normalize",
    "parallel",
    "plan_prefill",
    "prefill",
    "safe_gate",
]
__version__ = "0.1.0"
