"""The input helpers against their formulas in numpy, and the gate's bound on extreme inputs."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_kda
from jax_kda.oracle import production_inputs, recurrent_oracle, rms_ratio


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def test_safe_gate_matches_formula():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((7, 3, 128)).astype(np.float32)
    a_log = rng.standard_normal(3).astype(np.float32)
    dt_bias = rng.standard_normal((3, 128)).astype(np.float32)
    g = jax_kda.safe_gate(
        jnp.asarray(a), jnp.asarray(a_log), jnp.asarray(dt_bias), lower_bound=-4.0
    )
    expected = -4.0 * _sigmoid(np.exp(a_log)[:, None] * (a + dt_bias))
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-5, atol=1e-6)


def test_safe_gate_stays_in_bounds_on_extreme_inputs():
    a = jnp.asarray(np.array([-1e4, -50.0, 0.0, 50.0, 1e4], np.float32)[:, None, None]) * jnp.ones(
        (5, 2, 128), jnp.float32
    )
    g = np.asarray(jax_kda.safe_gate(a.astype(jnp.bfloat16)))
    assert np.all(np.isfinite(g)) and np.all(g >= -5.0) and np.all(g <= 0.0)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(lower_bound=-6.0), ValueError, r"lower_bound: got -6.0.*\[-5.0, 0\)"),
        (dict(lower_bound=0.0), ValueError, r"lower_bound: got 0.0"),
        (dict(lower_bound="x"), TypeError, r"lower_bound: got str"),
        (dict(a_log=jnp.zeros(3)), ValueError, r"a_log: got shape \(3,\), expected \(2,\)"),
        (dict(dt_bias=jnp.zeros((2, 64))), ValueError, r"dt_bias: got shape \(2, 64\)"),
    ],
)
def test_safe_gate_rejects_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        jax_kda.safe_gate(jnp.zeros((4, 2, 128)), **kwargs)


def test_l2_normalize_matches_formula_and_keeps_dtype():
    x = np.random.default_rng(1).standard_normal((5, 2, 128)).astype(np.float32)
    y = jax_kda.l2_normalize(jnp.asarray(x, jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    expected = xb / np.sqrt(np.sum(xb * xb, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(y, np.float32), expected, rtol=1e-2, atol=1e-2)


def test_prefill_on_prepared_inputs_matches_oracle():
    x = production_inputs([40, 0, 9], 2, seed=3)
    a = np.random.default_rng(4).standard_normal(x.g.shape).astype(np.float32)
    g = np.asarray(jax_kda.safe_gate(jnp.asarray(a)))
    q = np.asarray(jax_kda.l2_normalize(jnp.asarray(x.q) * 3))
    o, final = jax_kda.prefill(
        q,
        x.k,
        x.v,
        g,
        x.beta,
        cu_seqlens=x.cu_seqlens,
        initial_state=x.initial_state,
        gate_lower_bound=-5.0,
    )
    ref_o, ref_final = recurrent_oracle(q, x.k, x.v, g, x.beta, x.cu_seqlens, x.initial_state)
    assert rms_ratio(o, ref_o) <= 1e-2 and rms_ratio(final, ref_final) <= 1e-2
