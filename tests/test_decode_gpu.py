"""The decode step's sm90 kernel on a Hopper GPU (marker gpu; skipped elsewhere): against the
float64 oracle and the XLA step, dense states and pools with padding rows, grouped value heads,
hard resets, a NaN-poisoned output, vmap, and prefill token by token."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kda
from jax_kda import sm90
from jax_kda.oracle import (
    RMS_RATIO_BAR,
    long_memory_inputs,
    production_inputs,
    recurrent_oracle,
    rms_ratio,
)
from jax_kda.sm90.ffi_call import cute_call

pytestmark = pytest.mark.gpu

SEED = time.time_ns() % 2**31
STATE_BAR = 1e-5
"""The new state against the XLA step's (both float32; the kernel's exp is ex2.approx)."""


def _step_inputs(n, heads, value_heads, seed, *, resets=False, scale_state=1.0):
    """One token per sequence: L2-normalised q, k (bf16), v, g = -5 sigmoid(.) (some channels
    -inf where resets), beta in (0, 1), a random state [n, HV, 128, 128]."""
    rng = np.random.default_rng(seed)

    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q, k = (jnp.asarray(unit((n, heads, 128)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(0.5 * rng.standard_normal((n, value_heads, 128)), jnp.bfloat16)
    g = -5.0 / (1.0 + np.exp(-rng.standard_normal((n, value_heads, 128))))
    if resets:
        g[:, :, ::5] = -np.inf
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((n, value_heads))))
    state = scale_state * rng.standard_normal((n, value_heads, 128, 128))
    return (q, k, v, jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32),
            jnp.asarray(state, jnp.float32))  # fmt: skip


@pytest.mark.parametrize("heads, value_heads", [(4, 4), (2, 8)], ids=["mha", "gva"])
@pytest.mark.parametrize("resets", [False, True], ids=["gates", "resets"])
def test_decode_kernel_matches_the_xla_step_and_the_oracle(heads, value_heads, resets):
    seed = SEED + 3 * heads + resets
    print(f"seed {seed}")
    x = _step_inputs(37, heads, value_heads, seed, resets=resets)
    step = jax.jit(
        lambda *a, backend: jax_kda.decode(*a, backend=backend), static_argnames="backend"
    )
    o, state = step(*x, backend="sm90")
    ref_o, ref_state = step(*x, backend="xla")
    assert not np.isnan(np.asarray(o, np.float32)).any() and not np.isnan(state).any()
    err_o, err_state = rms_ratio(o, ref_o), rms_ratio(state, ref_state)
    print(f"decode {heads}/{value_heads} resets={resets}: o {err_o:.1e} state {err_state:.1e}")
    assert err_o <= 1e-2 and err_state <= STATE_BAR
    if heads == value_heads:
        cu = np.arange(x[0].shape[0] + 1, dtype=np.int32)
        oracle_o, oracle_state = recurrent_oracle(*x[:5], cu, np.asarray(x[5]))
        assert rms_ratio(o, oracle_o) <= RMS_RATIO_BAR
        assert rms_ratio(state, oracle_state) <= RMS_RATIO_BAR


def test_pool_rows_by_index_and_a_poisoned_output():
    """A pool of 9 rows, 6 sequences: indices in random order with padding (-1 and P), the
    kernel called directly on a NaN-poisoned o; the rows no index names stay bit for bit."""
    seed = SEED + 17
    print(f"seed {seed}")
    q, k, v, g, beta, _ = _step_inputs(6, 2, 2, seed)
    pool = jnp.asarray(np.random.default_rng(seed).standard_normal((9, 2, 128, 128)), jnp.float32)
    indices = jnp.asarray([7, -1, 2, 9, 0, 5], jnp.int32)
    artifact = sm90.decode_artifact(128**-0.5, True)
    results = [jax.ShapeDtypeStruct(pool.shape, jnp.float32),
               jax.ShapeDtypeStruct(v.shape, jnp.bfloat16)]  # fmt: skip

    @jax.jit
    def run(q, k, v, g, beta, indices, pool):
        poison = jnp.full(v.shape, jnp.nan, jnp.bfloat16)
        inputs = [q, k, v, g, beta, indices, pool, poison]
        return cute_call(artifact, inputs, results, aliases={6: 0, 7: 1})

    new_pool, o = run(q, k, v, g, beta, indices, pool)
    ref_o, ref_pool = jax_kda.decode(q, k, v, g, beta, pool, state_indices=indices, backend="xla")
    assert not np.isnan(np.asarray(o, np.float32)).any()
    assert rms_ratio(o, ref_o) <= 1e-2
    for row in (0, 2, 5, 7):
        assert rms_ratio(new_pool[row], ref_pool[row]) <= STATE_BAR, row
    for row in (1, 3, 4, 6, 8):
        np.testing.assert_array_equal(np.asarray(new_pool[row]), np.asarray(pool[row]))


@pytest.mark.parametrize("pool_batched", [True, False], ids=["pools", "one-pool"])
def test_vmap_equals_each_element(pool_batched):
    """vmap of pooled steps (one call on the folded batch): each element's own indices, with
    padding at -1, -2 and P (which must not land on the next element's rows), a batched pool
    or one pool that every element reads (and updates in its own copy)."""
    seed = SEED + 23
    print(f"seed {seed}")
    xs = [_step_inputs(5, 2, 4, seed + i) for i in range(3)]
    tokens = [jnp.stack(parts) for parts in zip(*(x[:5] for x in xs), strict=True)]
    pools = jnp.stack([x[5] for x in xs])
    indices = jnp.asarray([[4, -1, 0, 2, 3], [5, 1, -2, 0, 4], [3, 2, 1, 0, -1]], jnp.int32)
    step = lambda *a, idx: jax_kda.decode(*a, state_indices=idx, backend="sm90")  # noqa: E731
    if pool_batched:
        o, new_pools = jax.jit(jax.vmap(step))(*tokens, pools, idx=indices)
    else:
        one = lambda *a, idx: jax.vmap(step, in_axes=(0,) * 5 + (None,))(*a, idx=idx)  # noqa: E731
        o, new_pools = jax.jit(one)(*tokens, pools[0], idx=indices)
    for i in range(3):
        pool = pools[i] if pool_batched else pools[0]
        token = [t[i] for t in tokens]
        ref_o, ref_pool = jax_kda.decode(*token, pool, state_indices=indices[i], backend="xla")
        assert rms_ratio(o[i], ref_o) <= 1e-2
        assert rms_ratio(new_pools[i], ref_pool) <= STATE_BAR
        untouched = sorted(set(range(5)) - set(np.asarray(indices[i]).tolist()))
        for row in untouched:
            np.testing.assert_array_equal(np.asarray(new_pools[i][row]), np.asarray(pool[row]))


@pytest.mark.parametrize("make", [production_inputs, long_memory_inputs])
def test_kernel_steps_equal_the_oracle_token_by_token(make):
    """Packed sequences token by token through the kernel on a donated pool (a finished or
    empty sequence rides along at index -1) against the float64 oracle: o and the final
    states; the empty sequence's state bit for bit unchanged."""
    seed = SEED + 31
    print(f"seed {seed}")
    x = make([40, 0, 17, 64], 2, seed=seed)
    lengths = np.diff(x.cu_seqlens)
    step = jax.jit(
        lambda *a, idx: jax_kda.decode(*a, state_indices=idx, backend="sm90"), donate_argnums=5
    )
    pool = jnp.asarray(x.initial_state)
    o = np.full(x.q.shape, np.nan, np.float32)
    for t in range(int(lengths.max())):
        active = t < lengths
        rows = np.where(active, x.cu_seqlens[:-1] + t, 0)
        indices = jnp.asarray(np.where(active, np.arange(len(lengths)), -1), jnp.int32)
        token = [jnp.asarray(np.asarray(a)[rows]) for a in x[:5]]
        o_t, pool = step(*token, pool, idx=indices)
        o[rows[active]] = np.asarray(o_t, np.float32)[active]
    ref_o, ref_final = recurrent_oracle(*x)
    err_o, err_final = rms_ratio(o, ref_o), rms_ratio(pool, ref_final)
    print(f"token by token {make.__name__}: o {err_o:.1e} final {err_final:.1e}")
    assert not np.isnan(o).any()
    assert err_o <= RMS_RATIO_BAR and err_final <= RMS_RATIO_BAR
    np.testing.assert_array_equal(np.asarray(pool[1]), np.asarray(x.initial_state[1]))
