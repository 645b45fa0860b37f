"""The pure-XLA path against the float64 recurrent oracle, at the production gate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from spec_cases import MANY_SEQUENCES, PACKED_LENGTHS, SINGLE_LENGTHS

import jax_kda
from jax_kda.oracle import RMS_RATIO_BAR, production_inputs, recurrent_oracle, rms_ratio

# SPEC's length sets, with head counts and the long and many-sequence sizes cut to fit a 2-core
# CPU (the GPU tests run them in full).
RAGGED_CASES = {
    **{
        name: (lengths, 1 if sum(lengths) > 4096 else 2) for name, lengths in PACKED_LENGTHS.items()
    },
    "empty-edges": ([0, 33, 0, 16, 0], 2),
    "many-sequences": ([5, 16, 17, 40] * (MANY_SEQUENCES // 4), 2),
}


@jax.jit
def _run(q, k, v, g, beta, cu_seqlens, initial_state):
    return jax_kda.prefill(
        q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=initial_state, backend="xla"
    )


def _check(lengths, heads, seed):
    x = production_inputs(lengths, heads, seed=seed)
    o, final = _run(*x)
    assert o.dtype == jnp.bfloat16 and o.shape == x.q.shape
    assert final.shape == x.initial_state.shape
    ref_o, ref_final = recurrent_oracle(*x)
    if o.size:
        assert rms_ratio(o, ref_o) <= RMS_RATIO_BAR
    assert rms_ratio(final, ref_final) <= RMS_RATIO_BAR
    return x, o, final


@pytest.mark.parametrize("length", SINGLE_LENGTHS)
def test_single_sequence(length):
    _check([length], 2, seed=length)


@pytest.mark.parametrize("case", RAGGED_CASES)
def test_packed_sequences(case):
    lengths, heads = RAGGED_CASES[case]
    x, _, final = _check(lengths, heads, seed=len(case))
    # Empty sequences pass their state through untouched.
    for s, n in enumerate(lengths):
        if n == 0:
            np.testing.assert_array_equal(np.asarray(final[s]), x.initial_state[s])


def test_long_sequence():
    _check([4096], 1, seed=7)


def test_gate_far_below_production_bound_stays_exact():
    """exp(-Gamma) would overflow float32 here if the decay were factorised; ours must not."""
    x = production_inputs([40, 9, 150], 2, seed=3)  # 150: across 64-token chunks
    g = np.full_like(x.g, -30.0)
    g[::3] = -0.01
    x = x._replace(g=g)
    o, final = _run(*x)
    ref_o, ref_final = recurrent_oracle(*x)
    assert rms_ratio(o, ref_o) <= RMS_RATIO_BAR
    assert rms_ratio(final, ref_final) <= RMS_RATIO_BAR


def test_batched_form_equals_packed_form():
    batch, length, heads = 3, 37, 2
    x = production_inputs([length] * batch, heads, seed=11)
    o_thd, f_thd = _run(*x)
    as_rows = [a.reshape(batch, length, *a.shape[1:]) for a in (x.q, x.k, x.v, x.g, x.beta)]
    o_b, f_b = jax.jit(lambda *a, s: jax_kda.prefill(*a, initial_state=s, backend="xla"))(
        *as_rows, s=x.initial_state
    )
    assert o_b.shape == (batch, length, heads, 128)
    np.testing.assert_allclose(
        np.asarray(o_b, np.float32).reshape(o_thd.shape),
        np.asarray(o_thd, np.float32),
        atol=1e-2,
        rtol=1e-2,
    )
    np.testing.assert_allclose(np.asarray(f_b), np.asarray(f_thd), atol=1e-5, rtol=1e-5)
    assert rms_ratio(o_b.reshape(o_thd.shape), o_thd) <= 1e-3


def test_initial_state_none_equals_zeros():
    x = production_inputs([17, 0, 16], 2, seed=5)
    o0, f0 = _run(*x._replace(initial_state=np.zeros_like(x.initial_state)))
    o1, f1 = jax.jit(lambda *a, cu: jax_kda.prefill(*a, cu_seqlens=cu, backend="xla"))(
        *x[:5], cu=x.cu_seqlens
    )
    np.testing.assert_array_equal(np.asarray(o0), np.asarray(o1))
    np.testing.assert_array_equal(np.asarray(f0), np.asarray(f1))


def test_one_sequence_default_cu_seqlens_and_no_final_state():
    x = production_inputs([50], 2, seed=9)
    o, final = jax_kda.prefill(*x[:5], initial_state=x.initial_state, output_final_state=False)
    assert final is None
    ref_o, _ = recurrent_oracle(*x)
    assert rms_ratio(o, ref_o) <= RMS_RATIO_BAR


def test_custom_scale():
    x = production_inputs([33], 2, seed=13)
    o, f = jax_kda.prefill(*x[:5], initial_state=x.initial_state, scale=0.3)
    ref_o, ref_f = recurrent_oracle(*x, scale=0.3)
    assert rms_ratio(o, ref_o) <= RMS_RATIO_BAR
    assert rms_ratio(f, ref_f) <= RMS_RATIO_BAR


def test_new_lengths_same_shapes_do_not_retrace():
    traces = []

    @jax.jit
    def f(q, k, v, g, beta, cu):
        traces.append(1)
        return jax_kda.prefill(q, k, v, g, beta, cu_seqlens=cu)

    for seed, lengths in enumerate(([20, 12], [1, 31], [32, 0])):
        x = production_inputs(lengths, 1, seed=seed)
        o, _ = f(*x[:6])
        ref_o, _ = recurrent_oracle(*x[:6])
        assert rms_ratio(o, ref_o) <= RMS_RATIO_BAR
    assert len(traces) == 1


@pytest.mark.parametrize("gate", [-0.5, -5.0, -30.0])
def test_decayed_products_match_float64_pairwise(gate):
    """The in-chunk decayed products (4-row pairwise blocks, split elsewhere at a row between i
    and j) against the pairwise definition in float64, down to gates where exp(-Gamma) overflows."""
    from jax_kda import xla

    rng = np.random.default_rng(5)
    rows, dim = xla.XLA_CHUNK, 8
    q, k = rng.standard_normal((2, 3, rows, dim))
    g = gate * rng.uniform(0.0, 1.0, (3, rows, dim))
    gamma = np.cumsum(g, axis=1).astype(np.float32).astype(np.float64)  # both see the same input
    kk, qk = jax.jit(xla._decayed_products)(*(jnp.asarray(a, jnp.float32) for a in (q, k, gamma)))
    lower = np.tril(np.ones((rows, rows), bool))
    diff = gamma[:, :, None, :] - gamma[:, None, :, :]
    decay = np.where(lower[..., None], np.exp(np.where(lower[..., None], diff, 0.0)), 0.0)
    want_kk = np.where(lower, np.einsum("hid,hjd,hijd->hij", k, k, decay), 0)
    want_qk = np.where(lower, np.einsum("hid,hjd,hijd->hij", q, k, decay), 0)
    assert np.isfinite(np.asarray(kk)).all() and np.isfinite(np.asarray(qk)).all()
    np.testing.assert_allclose(np.asarray(kk), want_kk, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(qk), want_qk, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gate", [-0.5, -5.0, -30.0])
def test_decayed_products_gradient_matches_the_pairwise_definition(gate):
    """The hand-written backward of the decayed products (four decayed applications) against
    autodiff of the pairwise definition, down to gates where exp(-Gamma) overflows."""
    from jax_kda import xla

    rng = np.random.default_rng(6)
    rows, dim = xla.XLA_CHUNK, 8
    q, k = rng.standard_normal((2, 3, rows, dim))
    gamma = np.cumsum(gate * rng.uniform(0.0, 1.0, (3, rows, dim)), axis=1)
    weights = rng.standard_normal((2, 3, rows, rows))
    incl = jnp.tril(jnp.ones((rows, rows), bool))

    def pairwise(q, k, gamma):
        decay = jnp.exp(jnp.where(incl[..., None], gamma[:, :, None] - gamma[:, None], 0.0))
        kk = jnp.einsum("hid,hjd,hijd->hij", k, k, decay, precision="highest")
        qk = jnp.einsum("hid,hjd,hijd->hij", q, k, decay, precision="highest")
        return jnp.where(incl, kk, 0.0), jnp.where(incl, qk, 0.0)

    def gradients(products):
        def loss(q, k, gamma):
            kk, qk = products(q, k, gamma)
            return jnp.sum(kk * weights[0]) + jnp.sum(qk * weights[1])

        args = (jnp.asarray(a, jnp.float32) for a in (q, k, gamma))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)

    for got, want in zip(gradients(xla._decayed_products), gradients(pairwise), strict=True):
        got, want = np.asarray(got), np.asarray(want)
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
