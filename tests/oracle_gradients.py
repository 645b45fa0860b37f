"""Float64 gradients of the recurrent oracle: the one reference every gradient test compares to."""

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda.oracle import recurrent_oracle

HEADS_PER_CALL = 4
"""Heads per float64 oracle call: its autodiff keeps every token's [H, 128, 128] state, so many
heads at once (N = 64, H = 32) would not fit; heads are independent, so groups of them can go
one call at a time."""


def loss_weights(x, seed):
    """Random weights w_o [T, H, 128], w_f [N, H, 128, 128] (float32) of the test loss
    sum(o * w_o) + sum(final_state * w_f)."""
    rng = np.random.default_rng(seed)
    w_o = rng.standard_normal(x.q.shape).astype(np.float32)
    w_f = rng.standard_normal(x.initial_state.shape).astype(np.float32)
    return w_o, w_f


def float64_gradients(x, w_o, w_f, scale=None):
    """Gradients of sum(o * w_o) + sum(final_state * w_f) with respect to q, k, v, g, beta and
    the initial state, by float64 autodiff of the recurrence (numpy arrays, the inputs' shapes)."""
    with jax.enable_x64(True):

        def loss(q, k, v, g, beta, state, w_o, w_f):
            o, final = recurrent_oracle(q, k, v, g, beta, x.cu_seqlens, state, scale=scale)
            return jnp.sum(o * w_o) + jnp.sum(final * w_f)

        grad = jax.jit(jax.grad(loss, argnums=range(6)))
        groups = []
        for h in range(0, x.q.shape[1], HEADS_PER_CALL):
            heads = slice(h, h + HEADS_PER_CALL)
            args = [a[:, heads] for a in (*x[:5], x.initial_state, w_o, w_f)]
            groups.append(grad(*(jnp.asarray(a, jnp.float64) for a in args)))
        return [np.concatenate([np.asarray(g[i]) for g in groups], axis=1) for i in range(6)]
