"""The float64 recurrent oracle, the accuracy metric and SPEC's production inputs.

Used by the tests, the demo and the benchmarks to judge every backend; the library path never
imports it. The oracle is the token-by-token recurrence of SPEC, nothing chunked:

    S <- Diag(exp g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = scale * S^T q_t
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_kda.constants import GATE_LOWER_BOUND_MIN, HEAD_DIM, default_scale

RMS_RATIO_BAR = 1e-2
"""SPEC's bar for bf16 inputs at the production gate: o and final_state rms_ratio <= 1e-2."""


def rms_ratio(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out holds a NaN or inf (NaN never passes)."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"rms_ratio: shapes differ, {out.shape} vs {ref.shape}")
    if not np.all(np.isfinite(out)):
        return float("inf")
    denom = np.linalg.norm(ref)
    num = np.linalg.norm(out - ref)
    return float(num / denom) if denom > 0 else float(num)


def recurrent_oracle(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None):
    """KDA forward by the plain recurrence, in float64.

    Args:
      q, k, v, g: [T, H, 128]; beta: [T, H]; cu_seqlens: [N + 1] host integers;
      initial_state: [N, H, 128(V), 128(K)] or None.
    Returns:
      (o [T, H, 128], final_state [N, H, 128(V), 128(K)]), float64 jax arrays. Differentiable:
      call it under ``jax.enable_x64(True)`` to take float64 gradients.
    """
    with jax.enable_x64(True):
        q, k, v, g, beta = (jnp.asarray(x, jnp.float64) for x in (q, k, v, g, beta))
        cu = np.asarray(cu_seqlens, np.int64)
        total, heads, dim = q.shape
        num_seq = cu.shape[0] - 1
        if initial_state is None:
            initial_state = jnp.zeros((num_seq, heads, dim, dim), jnp.float64)
        init_kv = jnp.swapaxes(jnp.asarray(initial_state, jnp.float64), -1, -2)
        scale = default_scale(dim) if scale is None else float(scale)

        lengths = np.diff(cu)
        seq_of_token = np.repeat(np.arange(num_seq), lengths)
        is_start = np.zeros(total, bool)
        is_start[cu[:-1][lengths > 0]] = True

        def step(state, xs):
            q_t, k_t, v_t, g_t, b_t, start, seq = xs
            state = jnp.where(start, init_kv[seq], state)
            state = jnp.exp(g_t)[:, :, None] * state
            pred = jnp.einsum("hk,hkv->hv", k_t, state)
            state = state + b_t[:, None, None] * k_t[:, :, None] * (v_t - pred)[:, None, :]
            return state, (scale * jnp.einsum("hk,hkv->hv", q_t, state), state)

        xs = (q, k, v, g, beta, jnp.asarray(is_start), jnp.asarray(seq_of_token, jnp.int32))
        state0 = jnp.zeros((heads, dim, dim), jnp.float64)
        _, (o, states) = lax.scan(step, state0, xs)
        finals = [states[cu[s + 1] - 1] if lengths[s] > 0 else init_kv[s] for s in range(num_seq)]
        final = jnp.stack(finals) if finals else init_kv
        return o, jnp.swapaxes(final, -1, -2)


class Inputs(NamedTuple):
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray
    beta: np.ndarray
    cu_seqlens: np.ndarray
    initial_state: np.ndarray


def production_inputs(
    lengths, num_heads, *, seed, dtype=jnp.bfloat16, lower_bound=GATE_LOWER_BOUND_MIN
) -> Inputs:
    """SPEC's test inputs: L2-normalised q and k, v * 0.5, g = lb * sigmoid(randn),
    beta = sigmoid(randn), initial state 0.05 * randn. Host numpy arrays; q, k, v in ``dtype``."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    shape = (total, num_heads, HEAD_DIM)

    def l2norm(x):
        return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)

    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    q = l2norm(rng.standard_normal(shape, np.float32))
    k = l2norm(rng.standard_normal(shape, np.float32))
    v = 0.5 * rng.standard_normal(shape, np.float32)
    g = (lower_bound * sigmoid(rng.standard_normal(shape))).astype(np.float32)
    beta = sigmoid(rng.standard_normal((total, num_heads))).astype(np.float32)
    state_shape = (len(lengths), num_heads, HEAD_DIM, HEAD_DIM)
    initial_state = (0.05 * rng.standard_normal(state_shape)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cast = [np.asarray(jnp.asarray(x, dtype)) for x in (q, k, v)]
    return Inputs(*cast, g, beta, cu, initial_state)


def long_memory_inputs(lengths, num_heads, *, seed, dtype=jnp.bfloat16) -> Inputs:
    """Data that remembers: g = -0.05 * sigmoid(randn), exactly 0 on every 8th channel, initial
    state 0.5 * randn; q, k, v, beta as production_inputs. Dropping the initial state or a state
    carried between chunks changes o and the final state by far (the production gate forgets
    in about 7 tokens and hides such bugs)."""
    x = production_inputs(lengths, num_heads, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    g = (-0.05 / (1.0 + np.exp(-rng.standard_normal(x.g.shape)))).astype(np.float32)
    g[..., ::8] = 0.0
    initial_state = (0.5 * rng.standard_normal(x.initial_state.shape)).astype(np.float32)
    return x._replace(g=g, initial_state=initial_state)
