"""``jax_kda.decode``: one recurrent step per sequence, for serving, in plain JAX.

One token per sequence against the state layout ``prefill`` uses ([N, H, 128(V), 128(K)]
float32), optionally gathered from and scattered back into a pool of states by index (as
cuDNN's ``state_indices`` and vLLM's ``ssm_state_indices`` do). Per sequence and head, with the
stored state St = S^T ([V, K]):

    St <- St Diag(exp g)                      (decay per key channel)
    St <- St + beta (v - St k) k^T            (delta rule on the decayed state)
    o = scale * St q

which is prefill's recurrence for a one-token sequence. On a Hopper GPU (backend "auto" or
"sm90") one CuTe DSL kernel (jax_kda/sm90/kernels/kda_decode_sm90.py) reads and writes each
state once; elsewhere, and with backend="xla", the step is plain JAX.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_kda import sm90
from jax_kda.api import (
    BackendUnavailableError,
    _check_flags,
    _describe,
    _prepare_inputs,
    _require_array,
    _validate_scale,
    _validate_state,
    _validate_tokens,
)
from jax_kda.constants import GATE_FLOOR

_PRECISION = lax.Precision.HIGHEST
"""float32 products: on GPUs the default runs float32 matmuls as TF32, far coarser than prefill."""


def decode(
    q, k, v, g, beta, state, *, scale=None, state_indices=None, backend="auto",
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
    lower_bound=None, use_beta_sigmoid_in_kernel=False,
):  # fmt: skip
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
        and writes nothing. Valid indices must be distinct (two sequences on one row leave it
        undefined).
      backend: "auto" (the sm90 kernel where it can serve the call: a Hopper GPU, bfloat16 q,
        k, v, concrete sizes; else plain JAX), "sm90" (the kernel, or BackendUnavailableError
        saying why not) or "xla" (plain JAX everywhere).
      use_qk_l2norm_in_kernel, use_gate_in_kernel (with A_log, dt_bias, lower_bound) and
        use_beta_sigmoid_in_kernel: prefill's input preparation with fla's names (read
        prefill's docstring; g then holds the raw gate projection, beta the logits), in plain
        JAX before the step, differentiable for the raw inputs.

    Returns:
      (o, new_state): o [N, HV, 128] in q's dtype; new_state the state (or the pool) after the
      step, with the input's shape.

    In-place update: under ``jax.jit`` with the state donated (``jax.jit(decode_fn,
    donate_argnums=...)``), XLA writes the new state (or the pool's updated rows) into the
    donated buffer, and the input array is deleted; without donation each call copies the whole
    state or pool. Gradients: reverse mode (jax.grad, jax.vjp) on both backends (on the
    kernel path its custom VJP pulls the cotangents back through the XLA step); forward mode
    (jax.jvp, jax.jacfwd) only on the XLA one: the kernel path raises JAX's custom_vjp error
    there, so pass backend="xla" for it.
    """
    _check_flags(use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel)
    _validate_tokens(
        q, k, v, g, beta, layouts={3: "[N, H, 128]"}, raw_gate=use_gate_in_kernel,
        beta_logits=use_beta_sigmoid_in_kernel,
    )  # fmt: skip
    scale = _validate_scale(scale)
    if backend not in ("auto", "sm90", "xla"):
        raise ValueError(f"backend: got {backend!r}, expected 'auto', 'sm90' or 'xla'")
    q, k, g, beta, _ = _prepare_inputs(
        q, k, g, beta, None, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
        lower_bound, use_beta_sigmoid_in_kernel,
    )  # fmt: skip
    num_sequences, heads = v.shape[:2]
    if state_indices is not None:
        _check_pool(state, state_indices, num_sequences, heads)
    else:
        _validate_state("state", state, num_sequences, heads)
    if _kernel_serves(backend, q.dtype, num_sequences, state.shape):
        return _kernel_step(scale, q, k, v, g, beta, state, state_indices)
    return _xla_decode(q, k, v, g, beta, state, scale, state_indices)


def _kernel_serves(backend, dtype, num_sequences, state_shape) -> bool:
    """Whether the decode kernel runs this call: 'auto' where it can, 'sm90' or raise."""
    if backend == "xla":
        return False
    reason = sm90.decode_unavailable_reason(dtype, num_sequences, state_shape)
    if reason is None:
        return True
    if backend == "auto":
        return False
    raise BackendUnavailableError(f"backend='sm90' cannot serve this decode step: {reason}")


def _check_pool(state, state_indices, num_sequences, heads):
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kernel_step(scale, q, k, v, g, beta, state, state_indices):
    return _folded_kernel(scale, q, k, v, g, beta, state, state_indices)


def _kernel_step_fwd(scale, q, k, v, g, beta, state, state_indices):
    out = _folded_kernel(scale, q, k, v, g, beta, state, state_indices)
    return out, (q, k, v, g, beta, state, state_indices)


def _kernel_step_bwd(scale, saved, cotangents):
    *tokens, state, state_indices = saved
    step = lambda *a: _xla_decode(*a, scale, state_indices)  # noqa: E731
    _, pull = jax.vjp(step, *tokens, state)
    return (*pull(cotangents), None)


_kernel_step.defvjp(_kernel_step_fwd, _kernel_step_bwd)


def _folded_kernel(scale, q, k, v, g, beta, state, state_indices):
    """sm90.decode_kernel, run once under jax.vmap: a batch of V steps is one step of V * N
    sequences (pool rows offset by v * P, out-of-range indices kept out of range); a batch
    whose folded sizes would pass the kernel's limits (32-bit indexing), or an empty one, runs
    the kernel once per element instead."""
    pooled = state_indices is not None

    @jax.custom_batching.custom_vmap
    def run(*args):
        *tokens, state = args[:6]
        return sm90.decode_kernel(*tokens, state, scale, args[6] if pooled else None)

    @run.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [
            a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, batched in zip(args, in_batched, strict=True)
        ]
        v, state = args[2], args[5]
        folded = (axis_size * state.shape[1], *state.shape[2:])
        if axis_size == 0 or sm90.decode_unavailable_reason(
            v.dtype, axis_size * v.shape[1], folded
        ):  # fmt: skip
            out = jax.lax.map(lambda xs: run(*xs), tuple(args))
            return out, (True, True)
        merge = lambda x: x.reshape(axis_size * x.shape[1], *x.shape[2:])  # noqa: E731
        merged = [merge(a) for a in args[:6]]
        if pooled:
            indices, rows = args[6], state.shape[1]
            inside = (indices >= 0) & (indices < rows)
            offsets = rows * jnp.arange(axis_size, dtype=jnp.int32)[:, None]
            merged.append(merge(jnp.where(inside, indices + offsets, -1)))
        o, new_state = run(*merged)
        split = lambda x: x.reshape(axis_size, -1, *x.shape[1:])  # noqa: E731
        return (split(o), split(new_state)), (True, True)

    args = (q, k, v, g, beta, state) + ((state_indices,) if pooled else ())
    return run(*args)


def _xla_decode(q, k, v, g, beta, state, scale, state_indices):
    """The step in plain JAX (grouped heads repeated, the pool gathered and scattered)."""
    heads = v.shape[1]
    if heads != q.shape[1]:  # grouped value heads: value head j reads q and k head j // G
        q, k = (jnp.repeat(x, heads // q.shape[1], axis=1) for x in (q, k))
    if state_indices is None:
        new_state, o = _step(q, k, v, g, beta, state, scale)
        return o, new_state
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
