"""jax_kda.decode: token by token against prefill and the float64 oracle, state pools by index,
hard resets, buffer donation, gradients and named errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kda
from jax_kda.oracle import (
    RMS_RATIO_BAR,
    long_memory_inputs,
    production_inputs,
    recurrent_oracle,
    rms_ratio,
)

STEP_BAR = 1e-5
"""decode against prefill, float32 inputs: both float32, the chunked and the recurrent form."""


def _token(x, rows):
    """The [N, H, ...] slices of q, k, v, g, beta at packed rows `rows`."""
    return [jnp.asarray(a[rows]) for a in x[:5]]


def _decode_packed(x, pool, slots, seed):
    """Run every packed sequence of x token by token through jitted decode steps on `pool`,
    sequence n in pool row slots[n]: each step takes the next token of every sequence, and a
    finished (or empty) sequence rides along with index -1 and a random token (padding).
    Returns (o [T, H, 128] in q's dtype, the pool after the last step)."""
    lengths = np.diff(x.cu_seqlens)
    rng = np.random.default_rng(seed)
    step = jax.jit(lambda *a, idx: jax_kda.decode(*a, state_indices=idx), donate_argnums=5)
    o = np.full(x.q.shape, np.nan, np.float32)
    for t in range(int(lengths.max(initial=0))):
        active = t < lengths
        rows = np.where(active, x.cu_seqlens[:-1] + t, rng.integers(0, len(x.q), len(lengths)))
        indices = jnp.asarray(np.where(active, slots, -1), jnp.int32)
        o_t, pool = step(*_token(x, rows), pool, idx=indices)
        o[rows[active]] = np.asarray(o_t, np.float32)[active]
    return o, pool


@pytest.mark.parametrize(
    "make, dtype",
    [
        (production_inputs, jnp.float32),
        (long_memory_inputs, jnp.float32),
        (long_memory_inputs, jnp.bfloat16),
    ],
)
def test_token_by_token_equals_prefill_with_a_pool(make, dtype):
    lengths = [70, 0, 33, 5]  # 70: across the XLA path's 64-token chunks; 0: an empty sequence
    x = make(lengths, 2, seed=len(lengths) + (dtype == jnp.bfloat16), dtype=dtype)
    o_ref, final_ref = jax_kda.prefill(
        *x[:5], cu_seqlens=x.cu_seqlens, initial_state=x.initial_state, backend="xla"
    )
    rng = np.random.default_rng(3)
    pool_rows = 7
    slots = rng.permutation(pool_rows)[: len(lengths)]
    pool = (0.5 * rng.standard_normal((pool_rows, 2, 128, 128))).astype(np.float32)
    untouched = np.setdiff1d(np.arange(pool_rows), slots)
    pool[slots] = x.initial_state
    before = pool.copy()

    o, pool = _decode_packed(x, jnp.asarray(pool), slots, seed=5)
    pool = np.asarray(pool)
    np.testing.assert_array_equal(pool[untouched], before[untouched])
    np.testing.assert_array_equal(pool[slots[1]], before[slots[1]])  # the empty sequence
    assert o.dtype == np.float32 and not np.isnan(o).any()
    # Both compute in float32 from the same inputs; a bfloat16 o is rounded once on each side.
    assert rms_ratio(o, o_ref) <= (STEP_BAR if dtype == jnp.float32 else 1e-3)
    assert rms_ratio(pool[slots], final_ref) <= STEP_BAR
    ref_o, ref_final = recurrent_oracle(*x)
    assert rms_ratio(o, ref_o) <= RMS_RATIO_BAR
    assert rms_ratio(pool[slots], ref_final) <= RMS_RATIO_BAR


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_one_step_against_the_float64_oracle(dtype):
    x = long_memory_inputs([1] * 5, 3, seed=11, dtype=dtype)
    o, state = jax.jit(lambda *a: jax_kda.decode(*a, scale=0.3))(*x[:5], x.initial_state)
    assert o.dtype == dtype and o.shape == x.q.shape
    assert state.dtype == jnp.float32 and state.shape == x.initial_state.shape
    ref_o, ref_state = recurrent_oracle(*x, scale=0.3)
    assert rms_ratio(o, ref_o) <= (1e-6 if dtype == jnp.float32 else RMS_RATIO_BAR)
    assert rms_ratio(state, ref_state) <= 1e-6


def test_hard_reset_gives_no_nan_and_matches_prefill():
    """g = -inf zeroes those channels of the state; whole tokens and single channels, with a
    state that is large beforehand."""
    x = long_memory_inputs([12, 9], 2, seed=2, dtype=jnp.float32)
    g = x.g.copy()
    g[4] = -np.inf  # every channel of token 4 of sequence 0
    g[15, 1, ::3] = -np.inf  # a third of head 1's channels at token 3 of sequence 1
    x = x._replace(g=g)
    o_ref, final_ref = jax_kda.prefill(
        *x[:5], cu_seqlens=x.cu_seqlens, initial_state=x.initial_state, backend="xla"
    )
    o, state = _decode_packed(x, jnp.asarray(x.initial_state), np.arange(2), seed=0)
    assert np.isfinite(o).all() and np.isfinite(np.asarray(state)).all()
    assert rms_ratio(o, o_ref) <= STEP_BAR
    assert rms_ratio(state, final_ref) <= STEP_BAR
    ref_o, ref_final = recurrent_oracle(*x)
    assert rms_ratio(o, ref_o) <= 1e-5
    assert rms_ratio(state, ref_final) <= 1e-5


def test_out_of_range_indices_read_zeros_and_write_nothing():
    x = production_inputs([1, 1, 1], 1, seed=4, dtype=jnp.float32)
    pool = jnp.asarray(np.random.default_rng(0).standard_normal((4, 1, 128, 128)), jnp.float32)
    indices = jnp.asarray([2, -1, 4], jnp.int32)  # -1 and 4 (= P): padding
    o, new_pool = jax_kda.decode(*x[:5], pool, state_indices=indices)
    zero = np.zeros((2, 1, 128, 128), np.float32)
    ref_o, ref_state = recurrent_oracle(
        *x[:5], x.cu_seqlens, np.concatenate([np.asarray(pool[2:3]), zero])
    )
    assert rms_ratio(o, ref_o) <= 1e-6
    assert rms_ratio(new_pool[2], ref_state[0]) <= 1e-6
    for row in (0, 1, 3):
        np.testing.assert_array_equal(np.asarray(new_pool[row]), np.asarray(pool[row]))


@pytest.mark.parametrize("pooled", [False, True])
def test_donated_state_is_updated_in_place(pooled):
    x = production_inputs([1, 1], 2, seed=6)
    rows = 5 if pooled else 2
    indices = jnp.asarray([3, 0], jnp.int32) if pooled else None
    state = jnp.asarray(np.random.default_rng(1).standard_normal((rows, 2, 128, 128)), jnp.float32)
    expected = jax_kda.decode(*x[:5], state, state_indices=indices)[1]

    step = jax.jit(lambda *a, idx: jax_kda.decode(*a, state_indices=idx), donate_argnums=5)
    lowered = step.lower(*x[:5], state, idx=indices)
    assert "tf.aliasing_output = 1" in lowered.as_text()  # the state argument -> result 1
    assert "input_output_alias={ {1}: (5," in lowered.compile().as_text()
    _, new_state = step(*x[:5], state, idx=indices)
    assert state.is_deleted()
    np.testing.assert_allclose(np.asarray(new_state), np.asarray(expected), rtol=1e-6, atol=1e-6)


def test_gradients_equal_prefill_through_the_steps():
    """Plain autodiff through T decode steps against prefill's custom VJP, all six inputs."""
    x = long_memory_inputs([20, 20], 2, seed=8, dtype=jnp.float32)
    rng = np.random.default_rng(9)
    w_o = jnp.asarray(rng.standard_normal(x.q.shape), jnp.float32)
    w_f = jnp.asarray(rng.standard_normal(x.initial_state.shape), jnp.float32)
    per_step = [a.reshape(2, 20, *a.shape[1:]).swapaxes(0, 1) for a in (*x[:5], w_o)]

    def by_prefill(q, k, v, g, beta, state):
        o, final = jax_kda.prefill(
            q, k, v, g, beta, cu_seqlens=x.cu_seqlens, initial_state=state, backend="xla"
        )
        return jnp.sum(o * w_o) + jnp.sum(final * w_f)

    def by_decode(q, k, v, g, beta, state):
        def step(state, token):
            *inputs, w = token
            o, state = jax_kda.decode(*inputs, state)
            return state, jnp.sum(o * w)

        tokens = [a.reshape(2, 20, *a.shape[1:]).swapaxes(0, 1) for a in (q, k, v, g, beta)]
        final, losses = jax.lax.scan(step, state, (*tokens, per_step[5]))
        return jnp.sum(losses) + jnp.sum(final * w_f)

    args = (*x[:5], x.initial_state)
    want = jax.jit(jax.grad(by_prefill, argnums=range(6)))(*args)
    got = jax.jit(jax.grad(by_decode, argnums=range(6)))(*args)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), got, want, strict=True):
        assert rms_ratio(a, b) <= STEP_BAR, name


X = production_inputs([1, 1], 2, seed=0)
STATE = X.initial_state
BAD = {
    "q-rank": (dict(q=X.q[None]), ValueError, r"q: got shape \(1, 2, 2, 128\).*rank 3 \[N, H"),
    "q-head-dim": (dict(q=X.q[..., :64]), ValueError, r"q: got head dim 64"),
    "k-shape": (dict(k=X.k[:1]), ValueError, r"k: got shape \(1, 2, 128\).*\(2, 2, 128\)"),
    "v-dtype": (dict(v=X.v.astype(np.float32)), TypeError, r"v: got dtype float32.*bfloat16"),
    "g-dtype": (dict(g=X.g.astype(np.float16)), TypeError, r"g: got dtype float16.*float32"),
    "beta-shape": (dict(beta=X.beta[:, :1]), ValueError, r"beta: got shape \(2, 1\)"),
    "state-shape": (
        dict(state=STATE[:1]),
        ValueError,
        r"state: got shape \(1, 2, 128, 128\).*\(2, 2, 128, 128\) \[N, H, 128\(V\), 128\(K\)\]",
    ),
    "state-dtype": (
        dict(state=STATE.astype(np.float16)),
        TypeError,
        r"state: got dtype float16.*float32",
    ),
    "pool-heads": (
        dict(state=np.zeros((3, 1, 128, 128), np.float32), state_indices=np.zeros(2, np.int32)),
        ValueError,
        r"state: got shape \(3, 1, 128, 128\).*\(P, 2, 128, 128\) \[P, H",
    ),
    "pool-empty": (
        dict(state=np.zeros((0, 2, 128, 128), np.float32), state_indices=np.zeros(2, np.int32)),
        ValueError,
        r"state: got shape \(0, 2, 128, 128\).*at least one row",
    ),
    "indices-shape": (
        dict(state_indices=np.zeros(3, np.int32)),
        ValueError,
        r"state_indices: got shape \(3,\).*\(2,\)",
    ),
    "indices-dtype": (
        dict(state_indices=np.zeros(2, np.int64)),
        TypeError,
        r"state_indices: got dtype int64.*int32",
    ),
    "indices-list": (dict(state_indices=[0, 1]), TypeError, r"state_indices: got list"),
    "scale-nan": (dict(scale=float("nan")), ValueError, r"scale: got nan"),
    "backend": (dict(backend="cuda"), ValueError, r"backend: got 'cuda'"),
    "flag-not-bool": (
        dict(use_qk_l2norm_in_kernel=1),
        TypeError,
        r"use_qk_l2norm_in_kernel: got 1, expected",
    ),
    "a-log-without-gate": (
        dict(A_log=np.zeros(2, np.float32)),
        ValueError,
        r"A_log: given without use_gate_in_kernel",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_named(case):
    overrides, error, message = BAD[case]
    args = {**dict(q=X.q, k=X.k, v=X.v, g=X.g, beta=X.beta, state=STATE), **overrides}
    positional = [args.pop(n) for n in ("q", "k", "v", "g", "beta", "state")]
    with pytest.raises(error, match=message):
        jax_kda.decode(*positional, **args)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["safe-gate", "softplus-gate"])
def test_prepared_flags_step_by_step_equal_prefill(lower_bound):
    """fla's input flags on decode (q/k L2 norm, the gate from the raw a with A_log and
    dt_bias, beta logits; grouped value heads H = 1, HV = 2): the steps of each packed sequence
    against one prefill call with the same flags (float32 inputs), and the step itself against
    decode on inputs prepared by hand."""
    from oracle_gradients import raw_inputs

    x = raw_inputs([9, 4], 1, 2, seed=12, dtype=jnp.float32)
    flags = dict(
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=jnp.asarray(x.a_log),
        dt_bias=jnp.asarray(x.dt_bias), lower_bound=lower_bound, use_beta_sigmoid_in_kernel=True,
    )  # fmt: skip
    ref_o, ref_final = jax_kda.prefill(
        *(jnp.asarray(a) for a in x[:5]), cu_seqlens=jnp.asarray(x.cu_seqlens),
        initial_state=jnp.asarray(x.initial_state), backend="xla", **flags,
    )  # fmt: skip
    step = jax.jit(lambda *a: jax_kda.decode(*a, **flags))
    state = jnp.asarray(x.initial_state)
    starts, lengths = x.cu_seqlens[:-1], np.diff(x.cu_seqlens)
    o = np.zeros(np.shape(x.v), np.float32)
    for t in range(int(lengths.max())):
        rows = np.minimum(starts + t, starts + lengths - 1)
        o_t, new_state = step(*(jnp.asarray(a[rows]) for a in x[:5]), state)
        live = t < lengths
        state = jnp.where(live[:, None, None, None], new_state, state)
        o[rows[live]] = np.asarray(o_t)[live]
    assert rms_ratio(o, ref_o) <= STEP_BAR and rms_ratio(state, ref_final) <= STEP_BAR

    rows = starts
    q, k, v, a, b = (jnp.asarray(arr[rows]) for arr in x[:5])
    by_hand = (
        jax_kda.l2_normalize(q), jax_kda.l2_normalize(k), v,
        jax_kda.kda_gate(a, flags["A_log"], flags["dt_bias"], lower_bound=lower_bound),
        jax.nn.sigmoid(b),
    )  # fmt: skip
    got = jax_kda.decode(q, k, v, a, b, jnp.asarray(x.initial_state), **flags)
    want = jax_kda.decode(*by_hand, jnp.asarray(x.initial_state))
    for a_got, a_want in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a_got), np.asarray(a_want))
