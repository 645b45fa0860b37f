"""prefill's input preparation with fla's names (q/k L2 norm, the gate from its projection,
beta logits) and grouped value heads, on the XLA backend, against a float64 statement of the
whole (tests/oracle_gradients.py: prepared_float64), forward and every gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle_gradients import prepared_check, prepared_prefill, raw_inputs

import jax_kda
from jax_kda.oracle import recurrent_oracle, rms_ratio

BAR = 1e-2  # SPEC's: q, k, v are bf16 and the normalised q, k are rounded to bf16 again


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus-gate", "safe-gate"])
@pytest.mark.parametrize("groups", [1, 2], ids=["H", "GVA-2"])
def test_prepared_inputs_match_float64_forward_and_gradients(lower_bound, groups):
    """o, the final state and the gradients of all eight raw inputs (unnormalised q and k, v,
    the gate projection a, beta logits, the initial state, A_log and dt_bias) against float64
    autodiff of the prepared recurrence. A preparation dropped or done twice, a wrong head
    grouping or a gradient that misses a path misses the bar by far."""
    x = raw_inputs([90, 0, 70], 2, 2 * groups, seed=11 + groups)
    _, o = prepared_check(x, lower_bound, BAR, seed=5)
    if groups == 2:  # fla's grouping (value head j reads q, k head j // G), not a tiling (j % H)
        tiled = x._replace(q=np.tile(x.q, (1, 2, 1)), k=np.tile(x.k, (1, 2, 1)))
        o_tiled, _ = prepared_prefill(tiled, lower_bound)(
            *tiled[:5], x.initial_state, x.a_log, x.dt_bias
        )
        assert rms_ratio(o, o_tiled) > 0.1


def test_flags_equal_preparing_the_inputs_by_hand():
    """The flags are exactly the preparation written out (jax_kda.l2_normalize, kda_gate,
    sigmoid, jnp.repeat over the groups) followed by a plain call, bit for bit on XLA."""
    x = raw_inputs([40, 25], 2, 4, seed=3)
    o, final = jax.jit(prepared_prefill(x, -3.0))(*x[:5], x.initial_state, x.a_log, x.dt_bias)
    q, k = (jnp.repeat(jax_kda.l2_normalize(jnp.asarray(t)), 2, axis=1) for t in (x.q, x.k))
    g = jax_kda.kda_gate(jnp.asarray(x.a), x.a_log, x.dt_bias, lower_bound=-3.0)
    beta = jax.nn.sigmoid(jnp.asarray(x.beta))

    def plain(q, k, v, g, beta):
        return jax_kda.prefill(
            q, k, v, g, beta, cu_seqlens=x.cu_seqlens, initial_state=x.initial_state,
            scale=0.3, gate_lower_bound=-3.0,
        )  # fmt: skip

    by_hand = jax.jit(plain)(q, k, x.v, g, beta)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(by_hand[0]))
    np.testing.assert_array_equal(np.asarray(final), np.asarray(by_hand[1]))


def test_kda_gate_forms():
    """kda_gate against numpy: the softplus form without a bound, the safe form with one, dt_bias
    flat ([H * 128], fla) or [H, 128], A_log optional."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((7, 3, 128)).astype(np.float32)
    a_log = rng.standard_normal(3).astype(np.float32)
    bias = rng.standard_normal((3, 128)).astype(np.float32)
    pre = a + bias
    softplus = -np.exp(a_log)[:, None] * np.log1p(np.exp(pre))
    safe = -4.0 / (1.0 + np.exp(-np.exp(a_log)[:, None] * pre))
    np.testing.assert_allclose(jax_kda.kda_gate(a, a_log, bias.reshape(-1)), softplus, rtol=1e-5)
    np.testing.assert_allclose(jax_kda.kda_gate(a, a_log, bias, lower_bound=-4.0), safe, rtol=1e-5)
    unit = jax_kda.kda_gate(a, None, None, lower_bound=-4.0)
    np.testing.assert_allclose(unit, -4.0 / (1.0 + np.exp(-a)), rtol=1e-5)
    with pytest.raises(ValueError, match=r"dt_bias: got shape \(3, 64\)"):
        jax_kda.kda_gate(a, a_log, bias[:, :64])


def test_decode_with_grouped_value_heads_equals_repeated_q_and_k():
    x = raw_inputs([1, 1, 1], 2, 4, seed=9)
    q, k = (jax_kda.l2_normalize(jnp.asarray(t)) for t in (x.q, x.k))
    g = jax_kda.kda_gate(jnp.asarray(x.a), x.a_log, x.dt_bias)
    beta = jax.nn.sigmoid(jnp.asarray(x.beta))
    grouped = jax_kda.decode(q, k, x.v, g, beta, x.initial_state)
    repeated = jax_kda.decode(
        jnp.repeat(q, 2, axis=1), jnp.repeat(k, 2, axis=1), x.v, g, beta, x.initial_state
    )
    for a, b in zip(grouped, repeated, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ref_o, ref_final = recurrent_oracle(
        np.repeat(np.asarray(q, np.float32), 2, axis=1), np.repeat(np.asarray(k, np.float32), 2, 1),
        x.v, np.asarray(g), np.asarray(beta), x.cu_seqlens, x.initial_state,
    )  # fmt: skip
    assert rms_ratio(grouped[0], ref_o) <= BAR and rms_ratio(grouped[1], ref_final) <= BAR


def _call(**overrides):
    x = raw_inputs([20], 2, 2, seed=1)
    kwargs = {"q": x.q, "k": x.k, "v": x.v, "g": x.a, "beta": x.beta}
    options = {"initial_state": x.initial_state}
    options.update(overrides)
    positional = [options.pop(n, kwargs[n]) for n in ("q", "k", "v", "g", "beta")]
    return jax_kda.prefill(*positional, **options)


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        ({"lower_bound": -5.0}, ValueError, "lower_bound: given without use_gate_in_kernel"),
        ({"A_log": np.zeros(2, np.float32)}, ValueError, "A_log: given without"),
        ({"use_gate_in_kernel": 1}, TypeError, "use_gate_in_kernel: got 1, expected a bool"),
        ({"use_qk_l2norm_in_kernel": "yes"}, TypeError, "use_qk_l2norm_in_kernel: got 'yes'"),
        ({"use_gate_in_kernel": True, "lower_bound": -6.0}, ValueError, r"lower_bound: got -6"),
        ({"use_gate_in_kernel": True, "lower_bound": -3.0, "gate_lower_bound": -2.0}, ValueError,
         "gate_lower_bound: got -2.0, above lower_bound -3.0"),
        ({"use_gate_in_kernel": True, "gate_lower_bound": -5.0}, ValueError,
         "with the softplus gate .* which has no lower bound"),
        ({"use_gate_in_kernel": True, "dt_bias": np.zeros((2, 64), np.float32)}, ValueError,
         r"dt_bias: got shape \(2, 64\)"),
        ({"g": np.zeros((20, 2, 128), jnp.bfloat16)}, TypeError, "g: got dtype bfloat16"),
        ({"v": np.zeros((20, 3, 128), jnp.bfloat16)}, ValueError, "multiple of q's 2 heads"),
        ({"use_beta_sigmoid_in_kernel": False, "beta": np.zeros((20, 2), np.float16)}, TypeError,
         "beta: got dtype float16, expected float32"),
    ],
)  # fmt: skip
def test_preparation_arguments_are_checked(overrides, error, message):
    with pytest.raises(error, match=message):
        _call(**overrides)


@pytest.mark.parametrize("residuals", ["saved", "recompute"])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus-gate", "safe-gate"])
def test_in_kernel_route_pulls_gradients_back_through_the_preparation(
    monkeypatch, lower_bound, residuals
):
    """api._prepared_prefill, the route that hands the raw inputs to the sm90 kernels to
    prepare (sm90.backend.IN_KERNEL_PREP), with its kernel forward stood in for by the XLA
    preparation and forward, and the XLA path's forward and backward where it differentiates:
    o, the final state and all eight gradients equal prefill's with the flags on the XLA path
    (the same operations in the same order: the preparation's VJP after the plain
    backward), grouped value heads included (the route takes q and k with their own heads and
    repeats them with the preparations)."""
    from jax_kda import api, sm90, xla

    def standin(q, k, v, g, beta, cu, state, scale, **prep):
        groups = v.shape[1] // q.shape[1]
        assert prep["grouped_qk"] == (groups > 1)
        stated = api._Prep(prep["qk_l2norm"], prep["gate"], prep["lower_bound"],
                           prep["beta_logits"], groups)  # fmt: skip
        a_log = prep["a_log"] if prep["a_log"] is not None else jnp.zeros(v.shape[1])
        bias = prep["dt_bias"] if prep["dt_bias"] is not None else jnp.zeros((v.shape[1], 128))
        pq, pk, pg, pbeta = stated.apply(q, k, g, beta, a_log, bias)
        return xla.forward(pq, pk, v, pg, pbeta, cu, state, scale)

    monkeypatch.setattr(sm90, "prepared_forward", standin)
    x = raw_inputs([90, 0, 70], 2, 4, seed=21)
    call = api._Call(scale=0.3, backend="xla", batched=False, save_residuals=residuals == "saved")
    prep = api._Prep(True, True, lower_bound, True, groups=2)
    cu = jnp.asarray(x.cu_seqlens)

    def routed(q, k, v, a, b, state, a_log, dt_bias):
        return api._prepared_prefill(call, prep, q, k, v, a, b, a_log, dt_bias, cu, state)

    reference = prepared_prefill(x, lower_bound, residuals=residuals)
    args = (*x[:5], x.initial_state, x.a_log, x.dt_bias)
    weights = [np.random.default_rng(1).standard_normal(s).astype(np.float32)
               for s in (x.v.shape, x.initial_state.shape)]  # fmt: skip

    def loss(fn):
        def value(*args):
            o, final = fn(*args)
            return jnp.sum(o.astype(jnp.float32) * weights[0]) + jnp.sum(final * weights[1])

        return value

    for ours, theirs in zip(jax.jit(routed)(*args), jax.jit(reference)(*args), strict=True):
        np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
    grads = jax.jit(jax.grad(loss(routed), argnums=range(8)))(*args)
    ref_grads = jax.jit(jax.grad(loss(reference), argnums=range(8)))(*args)
    names = ("q", "k", "v", "a", "beta", "initial_state", "A_log", "dt_bias")
    for name, ours, theirs, arg in zip(names, grads, ref_grads, args, strict=True):
        assert ours.shape == np.shape(arg) and ours.dtype == theirs.dtype, name
        assert float(jnp.max(jnp.abs(theirs.astype(jnp.float32)))) > 0, name
        # the same operations in the same order (normalise, repeat; the pullbacks reversed)
        assert rms_ratio(ours, theirs) <= 1e-6, (name, rms_ratio(ours, theirs))


@pytest.mark.parametrize("batched", [False, True], ids=["packed", "batched"])
@pytest.mark.parametrize("groups", [1, 2], ids=["H", "GVA-2"])
def test_prefill_takes_the_in_kernel_route_with_raw_inputs_in_order(monkeypatch, groups, batched):
    """prefill's dispatch to the in-kernel route (sm90.backend.IN_KERNEL_PREP, an sm90_exact
    call that is not differentiated), the kernels stood in for by the XLA preparation and
    forward: it hands them the raw inputs in order (q and k with their own heads, the gate
    projection, beta logits, A_log, dt_bias) and the outputs equal the XLA path's, packed
    and in the batched [B, T, H, 128] form (v's heads for o)."""
    from jax_kda import api, sm90, xla

    seen = {}

    def standin(q, k, v, g, beta, cu, state, scale, **prep):
        seen.update(prep, q_heads=q.shape[1])
        groups = v.shape[1] // q.shape[1]
        stated = api._Prep(prep["qk_l2norm"], prep["gate"], prep["lower_bound"],
                           prep["beta_logits"], groups)  # fmt: skip
        pq, pk, pg, pbeta = stated.apply(q, k, g, beta, prep["a_log"], prep["dt_bias"])
        return xla.forward(pq, pk, v, pg, pbeta, cu, state, scale)

    length = 40
    x = raw_inputs([length] * 3, 2, 2 * groups, seed=23)
    args = (*x[:5], x.initial_state, x.a_log, x.dt_bias)
    cu = None if batched else jnp.asarray(x.cu_seqlens)

    def call(backend, q, k, v, a, b, state, a_log, dt_bias):
        if batched:  # three rows of 40 tokens
            q, k, v, a, b = (t.reshape(3, length, *t.shape[1:]) for t in (q, k, v, a, b))
        o, final = jax_kda.prefill(
            q, k, v, a, b, cu_seqlens=cu, initial_state=state, scale=0.3,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=a_log,
            dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, backend=backend,
        )  # fmt: skip
        return o.reshape(-1, *o.shape[-2:]), final

    reference = jax.jit(functools.partial(call, "xla"))(*args)
    monkeypatch.setattr(sm90, "prepared_forward", standin)
    monkeypatch.setattr(sm90.backend, "IN_KERNEL_PREP", True)
    monkeypatch.setattr(api, "_resolve_backend", lambda *a: "sm90_exact")
    routed = jax.jit(functools.partial(call, "sm90"))(*args)
    assert seen["q_heads"] == 2 and seen["grouped_qk"] == (groups > 1), seen
    assert seen["qk_l2norm"] and seen["gate"] and seen["beta_logits"], seen
    for ours, theirs in zip(routed, reference, strict=True):
        assert ours.shape == theirs.shape
        # the batched XLA path runs a vmap over rows, the route one packed call: the same
        # arithmetic summed in another order (about 3e-6); a misrouted input is off by O(1)
        assert rms_ratio(ours, theirs) <= 1e-4, rms_ratio(ours, theirs)


def test_in_kernel_route_is_one_call_under_vmap(monkeypatch):
    """jax.vmap of prefill on the in-kernel route (the kernels stood in for as above) runs
    them once on the packed batch, A_log and dt_bias shared; a batch that varies A_log runs
    element by element. Either way the outputs equal the XLA path's under the same vmap."""
    from jax_kda import api, sm90, xla

    calls = []

    def standin(q, k, v, g, beta, cu, state, scale, **prep):
        calls.append(q.shape[0])
        stated = api._Prep(prep["qk_l2norm"], prep["gate"], prep["lower_bound"],
                           prep["beta_logits"], v.shape[1] // q.shape[1])  # fmt: skip
        pq, pk, pg, pbeta = stated.apply(q, k, g, beta, prep["a_log"], prep["dt_bias"])
        return xla.forward(pq, pk, v, pg, pbeta, cu, state, scale)

    xs = [raw_inputs([30, 0, 34], 2, 4, seed=31 + i) for i in range(2)]
    stacked = [np.stack(parts) for parts in zip(*(x[:5] for x in xs), strict=True)]
    states = np.stack([x.initial_state for x in xs])
    a_logs = np.stack([x.a_log for x in xs])
    cu = jnp.asarray(xs[0].cu_seqlens)

    def call(backend, q, k, v, a, b, state, a_log, dt_bias):
        return jax_kda.prefill(
            q, k, v, a, b, cu_seqlens=cu, initial_state=state, scale=0.3,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=a_log,
            dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, backend=backend,
        )  # fmt: skip

    shared = (0, 0, 0, 0, 0, 0, None, None)
    varied = (0, 0, 0, 0, 0, 0, 0, None)
    for axes, a_log, most_tokens in ((shared, xs[0].a_log, 128), (varied, a_logs, 64)):
        args = (*stacked, states, a_log, xs[0].dt_bias)
        reference = jax.vmap(functools.partial(call, "xla"), in_axes=axes)(*args)
        with monkeypatch.context() as patch:
            patch.setattr(sm90, "prepared_forward", standin)
            patch.setattr(sm90.backend, "IN_KERNEL_PREP", True)
            patch.setattr(api, "_resolve_backend", lambda *a: "sm90_exact")
            patch.setattr(api, "_too_big_for_one_call", lambda *a: False)  # no GPU to ask
            calls.clear()
            routed = jax.vmap(functools.partial(call, "sm90"), in_axes=axes)(*args)
        # traced for the batch as one packed call (beside custom_vmap's trace of one element
        # for the output shapes), or element by element
        assert max(calls) == most_tokens, calls
        for ours, theirs in zip(routed, reference, strict=True):
            assert rms_ratio(ours, theirs) <= 1e-4, rms_ratio(ours, theirs)
