"""Float64 gradients of the recurrent oracle: the one reference every gradient test compares to."""

import hashlib
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_kda.oracle import recurrent_oracle, rms_ratio

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


_REFERENCES: dict[str, list[np.ndarray]] = {}
"""float64_gradients' results by their inputs' digest: the same data checked twice (the GPU
gradient tests run every case with both residual choices) costs one oracle run."""


def _digest(*arrays, scale) -> str:
    h = hashlib.sha256(repr(scale).encode())
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def float64_gradients(x, w_o, w_f, scale=None):
    """Gradients of sum(o * w_o) + sum(final_state * w_f) with respect to q, k, v, g, beta and
    the initial state, by float64 autodiff of the recurrence (numpy arrays, the inputs' shapes;
    fresh copies of a result kept for inputs seen before)."""
    key = _digest(*x[:6], x.initial_state, w_o, w_f, scale=scale)
    if key not in _REFERENCES:
        _REFERENCES[key] = _float64_gradients(x, w_o, w_f, scale)
    return [g.copy() for g in _REFERENCES[key]]


def _float64_gradients(x, w_o, w_f, scale):
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


class RawInputs(NamedTuple):
    """Inputs before prefill's input preparation: q, k [T, H, 128] unnormalised; v [T, HV, 128];
    a (the gate projection) [T, HV, 128]; beta logits [T, HV]; A_log [HV]; dt_bias [HV * 128]
    (fla's layout); cu_seqlens; initial_state [N, HV, 128, 128]."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    a: np.ndarray
    beta: np.ndarray
    cu_seqlens: np.ndarray
    initial_state: np.ndarray
    a_log: np.ndarray
    dt_bias: np.ndarray


def raw_inputs(lengths, heads, value_heads, *, seed, dtype=jnp.bfloat16) -> RawInputs:
    """Fresh random raw inputs (fla's test settings: A_log = log U(1, 16)), q, k, v in dtype."""
    rng = np.random.default_rng(seed)
    total = int(np.sum(lengths))
    qk = (total, heads, 128)
    vg = (total, value_heads, 128)
    cast = [np.asarray(jnp.asarray(rng.standard_normal(s), dtype)) for s in (qk, qk, vg)]
    state = (0.1 * rng.standard_normal((len(lengths), value_heads, 128, 128))).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return RawInputs(
        *cast,
        rng.standard_normal(vg).astype(np.float32),
        rng.standard_normal((total, value_heads)).astype(np.float32),
        cu,
        state,
        np.log(rng.uniform(1.0, 16.0, value_heads)).astype(np.float32),
        (0.5 * rng.standard_normal(value_heads * 128)).astype(np.float32),
    )


def prepared_float64(x: RawInputs, w_o, w_f, *, lower_bound=None, scale=None):
    """The float64 statement of prefill with every input preparation on (q/k L2 norm, the gate
    from a, A_log and dt_bias: the safe form with lower_bound, else fla's softplus form; beta
    logits; q and k repeated over grouped value heads): (o, final_state) and the gradients of
    sum(o * w_o) + sum(final * w_f) for q, k, v, a, beta, initial_state, A_log, dt_bias."""
    with jax.enable_x64(True):

        def outputs(q, k, v, a, b, state, a_log, dt_bias):
            def l2(x):
                return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)

            groups = v.shape[1] // q.shape[1]
            q, k = (jnp.repeat(l2(t), groups, axis=1) for t in (q, k))
            pre = a + dt_bias.reshape(-1, 128)
            amplitude = jnp.exp(a_log)[:, None]
            if lower_bound is None:
                g = -amplitude * jax.nn.softplus(pre)
            else:
                g = lower_bound * jax.nn.sigmoid(amplitude * pre)
            beta = jax.nn.sigmoid(b)
            return recurrent_oracle(q, k, v, g, beta, x.cu_seqlens, state, scale=scale)

        def loss(*args):
            o, final = outputs(*args)
            return jnp.sum(o * w_o) + jnp.sum(final * w_f)

        args = [jnp.asarray(t, jnp.float64) for t in (*x[:5], x.initial_state, x.a_log, x.dt_bias)]
        o, final = jax.jit(outputs)(*args)
        grads = jax.jit(jax.grad(loss, argnums=range(8)))(*args)
        return np.asarray(o), np.asarray(final), [np.asarray(t) for t in grads]


def prepared_prefill(x: RawInputs, lower_bound, **options):
    """prefill with every input preparation on, as prepared_float64 states it (scale 0.3):
    call(q, k, v, a, beta, initial_state, A_log, dt_bias) -> (o, final_state)."""
    import jax_kda

    def call(q, k, v, a, b, state, a_log, dt_bias):
        return jax_kda.prefill(
            q, k, v, a, b, cu_seqlens=x.cu_seqlens, initial_state=state, scale=0.3,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=a_log,
            dt_bias=dt_bias, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=True,
            **options,
        )  # fmt: skip

    return call


def prepared_check(x: RawInputs, lower_bound, bar, seed, **options):
    """prepared_prefill against prepared_float64: o, the final state and the gradients of the
    eight raw inputs (loss sum(o * w_o) + sum(final * w_f), random weights), each within bar;
    returns the errors by name for printing."""
    rng = np.random.default_rng(seed)
    w_o = rng.standard_normal(x.v.shape).astype(np.float32)
    w_f = rng.standard_normal(x.initial_state.shape).astype(np.float32)
    call = prepared_prefill(x, lower_bound, **options)

    def loss(*args):
        o, final = call(*args)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(final * w_f)

    args = (*x[:5], x.initial_state, x.a_log, x.dt_bias)
    o, final = jax.jit(call)(*args)
    grads = jax.jit(jax.grad(loss, argnums=range(8)))(*args)
    ref_o, ref_final, ref_grads = prepared_float64(x, w_o, w_f, lower_bound=lower_bound, scale=0.3)
    errors = {"o": rms_ratio(o, ref_o), "final_state": rms_ratio(final, ref_final)}
    names = ("q", "k", "v", "a", "beta", "initial_state", "A_log", "dt_bias")
    for name, ours, ref, arg in zip(names, grads, ref_grads, args, strict=True):
        assert ours.shape == np.shape(arg), name
        assert not np.isnan(np.asarray(ours)).any(), name
        errors["d" + name] = rms_ratio(ours, ref)
    for name, error in errors.items():
        # dA_log (one number a head) sums dg * g over every token and channel: a small
        # difference of large terms under the softplus gate, 7e-3 on the XLA path in float32
        # ([300, 0, 77, 130], H = 2, HV = 4); a missed path is off by O(1).
        assert error <= (2 * bar if name == "dA_log" else bar), (name, error)
    return errors, np.asarray(o)


PREPARATIONS = [flags for flags in itertools.product((False, True), repeat=4) if any(flags)]
"""Every combination of the in-kernel preparations (qk_l2norm, gate, beta_logits, grouped_qk),
none alone excepted: the flags' settings prefill can hand to the kernels."""


def preparation_id(combination) -> str:
    names = ("norm", "gate", "beta", "gva")
    return "+".join(n for n, on in zip(names, combination, strict=True) if on)


def preparation_case(x: RawInputs, combination, lower_bound):
    """One combination of the in-kernel preparations on raw inputs x (groups = HV / H value
    heads a q head): (InputPrep, the raw inputs the kernel takes (q, k, v, g or a, beta or its
    logits), its (A_log, dt_bias [HV, 128]) or (None, None), and the inputs the plain kernels
    take, prepared in XLA by jax_kda.gate, q and k repeated over the groups). What a
    combination leaves out comes prepared: q and k normalised ahead, g the gate of a (the safe
    form with lower_bound, else fla's softplus form), beta the sigmoid of its logits."""
    from jax_kda import gate
    from jax_kda.sm90.kernels.input_prep import InputPrep

    norm, with_gate, logits, grouped = combination
    groups = x.v.shape[1] // x.q.shape[1]
    q, k, v, a, beta = (jnp.asarray(t) for t in (x.q, x.k, x.v, x.a, x.beta))
    a_log = jnp.asarray(x.a_log)
    dt_bias = jnp.asarray(x.dt_bias).reshape(x.v.shape[1], 128)
    g = gate.kda_gate(a, a_log, dt_bias, lower_bound=lower_bound)
    b = jax.nn.sigmoid(beta)
    q_norm, k_norm = gate.l2_normalize(q), gate.l2_normalize(k)
    prepared = (
        *(jnp.repeat(t, groups, axis=1) for t in (q_norm, k_norm)),
        v,
        g,
        b,
    )
    raw_q, raw_k = (q, k) if norm else (q_norm, k_norm)
    if not grouped:  # the kernel reads q and k at every value head: repeated ahead
        raw_q, raw_k = (jnp.repeat(t, groups, axis=1) for t in (raw_q, raw_k))
    raw = (raw_q, raw_k, v, a if with_gate else g, beta if logits else b)
    prep = InputPrep(
        qk_l2norm=norm,
        gate=with_gate,
        lower_bound=lower_bound if with_gate else None,
        beta_logits=logits,
        grouped_qk=grouped,
    )
    params = (a_log, dt_bias) if with_gate else (None, None)
    return prep, raw, params, prepared
