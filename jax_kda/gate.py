"""Input preparation in plain JAX: the safe gate and the q/k L2 normalisation KDA models apply
before the recurrence (SPEC's optional fusions, here as separate jittable functions)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda.constants import GATE_LOWER_BOUND_MIN, HEAD_DIM, L2_EPS


def safe_gate(a, a_log=None, dt_bias=None, *, lower_bound=GATE_LOWER_BOUND_MIN):
    """Kimi K3's lower-bounded ("safe") gate: lb * sigmoid(exp(a_log[h]) * (a + dt_bias[h])).

    Args:
      a: [..., H, 128], the gate projection, any float dtype (computed in float32).
      a_log: [H] or None (amplitude 1). dt_bias: [H, 128] (or fla's flat [H * 128]) or None
        (no bias).
      lower_bound: lb, a Python float in [-5, 0).
    Returns:
      g: a's shape, float32, every value in [lb, 0): pass gate_lower_bound=lb to prefill.
    """
    check_lower_bound(lower_bound)
    return kda_gate(a, a_log, dt_bias, lower_bound=lower_bound)


def kda_gate(a, a_log=None, dt_bias=None, *, lower_bound=None):
    """fla's KDA gate (its `use_gate_in_kernel` forms), in float32:
    lower_bound None: g = -exp(a_log[h]) * softplus(a + dt_bias[h]) (Kimi Linear; any g <= 0);
    else the safe gate g = lb * sigmoid(exp(a_log[h]) * (a + dt_bias[h])), every g in [lb, 0).

    a: [..., H, 128], any float dtype; a_log: [H] or None (amplitude 1); dt_bias: [H, 128] or
    [H * 128] (fla's layout) or None (no bias); lower_bound: None or a Python float in [-5, 0).
    """
    if lower_bound is not None:
        check_lower_bound(lower_bound)
    if a.ndim < 2 or a.shape[-1] != HEAD_DIM:
        raise ValueError(f"a: got shape {tuple(a.shape)}, expected [..., H, {HEAD_DIM}]")
    heads = a.shape[-2]
    x = a.astype(jnp.float32)
    if dt_bias is not None:
        if tuple(dt_bias.shape) not in ((heads, HEAD_DIM), (heads * HEAD_DIM,)):
            raise ValueError(
                f"dt_bias: got shape {tuple(dt_bias.shape)}, expected ({heads}, {HEAD_DIM}) "
                f"or ({heads * HEAD_DIM},)"
            )
        x = x + dt_bias.astype(jnp.float32).reshape(heads, HEAD_DIM)
    amplitude = jnp.ones((heads,), jnp.float32)
    if a_log is not None:
        if tuple(a_log.shape) != (heads,):
            raise ValueError(f"a_log: got shape {tuple(a_log.shape)}, expected ({heads},)")
        amplitude = jnp.exp(a_log.astype(jnp.float32))
    if lower_bound is None:
        return -amplitude[:, None] * jax.nn.softplus(x)
    return lower_bound * jax.nn.sigmoid(x * amplitude[:, None])


def check_lower_bound(lower_bound, name: str = "lower_bound") -> None:
    """A gate's lower bound: a real number in [-5, 0), or a TypeError / ValueError naming the
    argument (`name`), the value seen and what was expected."""
    if isinstance(lower_bound, bool) or not isinstance(
        lower_bound, (int, float, np.floating, np.integer)
    ):
        raise TypeError(f"{name}: got {type(lower_bound).__name__}, expected a Python float")
    if not GATE_LOWER_BOUND_MIN <= float(lower_bound) < 0:
        raise ValueError(
            f"{name}: got {lower_bound}, expected a number in [{GATE_LOWER_BOUND_MIN}, 0)"
        )


def l2_normalize(x):
    """x * rsqrt(sum(x^2) + 1e-6) over the last axis, in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + L2_EPS)).astype(
        x.dtype
    )
