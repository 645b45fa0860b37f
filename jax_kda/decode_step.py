"""``jax_kda.decode``: one recurrent step per sequence, for serving, in plain JAX.

One token per sequence against the state layout ``prefill`` uses ([N, H, 128(V), 128(K)]
float32), optionally gathered from and scattered back into a pool of states by index (as
cuDNN's ``state_indices`` and vLLM's ``ssm_state_indices`` do). Per sequence and head, with the
stored state St = S^T ([V, K]):

    St <- St Diag(exp g)                      (decay per key channel)
    St <- St + beta (v - St k) k^T            (delta rule on the decayed state)
    o = scale * St q

which is prefill's recurrence for a one-token sequence.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_kda.api import (
    _describe,
    _require_array,
    _validate_scale,
    _validate_state,
    _validate_tokens,
)
from jax_kda.constants import GATE_FLOOR

_PRECISION = lax.Precision.HIGHEST
"""float32 products: on GPUs the default runs float32 matmuls as TF32, far coarser than prefill."""


def decode(q, k, v, g, beta, state, *, scale=None, state_indices=None):
    """One KDA decode step: a token per sequence, the state updated; jittable, differentiable.

    Args:
      q, k, v: [N, H, 128] bfloat16, float16 or float32 (one dtype); q and k are expected
        L2-normalised. Grouped value heads as in prefill: q and k may have H heads and v, g,
        beta and the state HV = G * H (HV = H without them).
      g: [N, HV, 128] float32, the per-channel natural-log decay (<= 0; -inf resets the channel:
        gates below -100 are taken as -100, as in prefill).
      beta: [N, HV] float32, in (0, 1).
      state: [N, HV, 128, 128] float32, stored transposed ([V, K]) as prefill's states; with
        state_indices, a pool [P, HV, 128, 128] of states.
      scale: finite Python float; None means 128 ** -0.5.
      state_indices: None, or [N] int32: sequence n reads and writes pool row
        state_indices[n]. An index outside [0, P) (vLLM's padding slot, -1) reads a zero state
        and writes nothing. Valid indices must be distinct (two writes to one row leave either).

    Returns:
      (o, new_state): o [N, HV, 128] in q's dtype; new_state the state (or the pool) after the
      step, with the input's shape.

    In-place update: under ``jax.jit`` with the state donated (``jax.jit(decode_fn,
    donate_argnums=...)``), XLA writes the new state (or the pool's updated rows) into the
    donated buffer, and the input array is deleted; without donation each call copies the whole
    state or pool. Gradients are plain JAX autodiff (no custom VJP).
    """
    _validate_tokens(q, k, v, g, beta, layouts={3: "[N, H, 128]"})
    scale = _validate_scale(scale)
    num_sequences, heads = v.shape[:2]
    if heads != q.shape[1]:  # grouped value heads: value head j reads q and k head j // G
        q, k = (jnp.repeat(x, heads // q.shape[1], axis=1) for x in (q, k))
    if state_indices is None:
        _validate_state("state", state, num_sequences, heads)
        new_state, o = _step(q, k, v, g, beta, state, scale)
        return o, new_state

    _require_array("state_indices", state_indices)
    if state_indices.shape != (num_sequences,):
        raise ValueError(
            f"state_indices: got {_describe(state_indices)}, expected shape ({num_sequences},) "
            "[N], one pool row per sequence"
        )
    if state_indices.dtype != jnp.int32:
        raise TypeError(f"state_indices: got dtype {state_indices.dtype}, expected int32")
    _validate_state("state", state, None, heads, rows_name="P")
    if state.shape[0] == 0:
        raise ValueError(f"state: got {_describe(state)}, expected a pool of at least one row")
    # Out-of-range indices (negative ones too: no wrapping) read zeros and write nothing.
    pool = state.at[state_indices]
    rows = pool.get(mode="fill", fill_value=0.0, wrap_negative_indices=False)
    new_rows, o = _step(q, k, v, g, beta, rows, scale)
    return o, pool.set(new_rows, mode="drop", wrap_negative_indices=False)


def _step(q, k, v, g, beta, state, scale):
    """The recurrence on [N, H, ...] in float32; returns (new state [N, H, V, K], o)."""
    out_dtype = q.dtype
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    decay = jnp.exp(jnp.maximum(g, GATE_FLOOR))  # [N, H, K]
    # (St Diag(decay)) x = St (decay * x): the decay goes onto k and q, so no decayed copy of
    # the state is made. St k and St q in one pass over the state: o = scale * St_new q needs
    # only St q, the correction and k . q; the update is then one more pass that reads the
    # state and writes the new one.
    products = jnp.einsum(
        "nhvk,nhjk->nhjv", state, jnp.stack([k, q], axis=2) * decay[:, :, None, :],
        precision=_PRECISION,
    )  # fmt: skip
    correction = beta[..., None] * (v - products[:, :, 0])  # [N, H, V]
    new_state = state * decay[:, :, None, :] + correction[..., None] * k[:, :, None, :]
    k_dot_q = jnp.sum(k * q, axis=-1, keepdims=True)
    o = scale * (products[:, :, 1] + correction * k_dot_q)
    return new_state, o.astype(out_dtype)
