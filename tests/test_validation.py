"""Every bad input raises ValueError or TypeError naming the argument, value and expectation."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_kda
from jax_kda.oracle import production_inputs

T, H = 20, 2
X = production_inputs([12, 8], H, seed=0)
GOOD = dict(
    q=X.q, k=X.k, v=X.v, g=X.g, beta=X.beta, cu_seqlens=X.cu_seqlens, initial_state=X.initial_state
)


def _call(**overrides):
    args = {**GOOD, **overrides}
    positional = [args.pop(n) for n in ("q", "k", "v", "g", "beta")]
    return jax_kda.prefill(*positional, **args)


BAD = {
    "q-rank": (dict(q=X.q[0]), ValueError, r"q: got shape \(2, 128\).*rank 3"),
    "q-head-dim": (dict(q=X.q[..., :64]), ValueError, r"q: got head dim 64.*expected 128"),
    "q-dtype": (dict(q=X.q.astype(np.int32)), TypeError, r"q: got dtype int32.*bfloat16"),
    "k-shape": (
        dict(k=X.k[:10]),
        ValueError,
        r"k: got shape \(10, 2, 128\).*expected shape \(20, 2, 128\)",
    ),
    "v-dtype": (dict(v=X.v.astype(np.float32)), TypeError, r"v: got dtype float32.*bfloat16"),
    "g-dtype": (
        dict(g=jnp.asarray(X.g, jnp.bfloat16)),
        TypeError,
        r"g: got dtype bfloat16.*float32",
    ),
    "beta-shape": (dict(beta=X.beta[:, :1]), ValueError, r"beta: got shape \(20, 1\).*\(20, 2\)"),
    "beta-dtype": (dict(beta=X.beta.astype(np.float16)), TypeError, r"beta: got dtype float16"),
    "cu-dtype": (
        dict(cu_seqlens=X.cu_seqlens.astype(np.int64)),
        TypeError,
        r"cu_seqlens: got dtype int64.*int32",
    ),
    "cu-rank": (
        dict(cu_seqlens=X.cu_seqlens[None]),
        ValueError,
        r"cu_seqlens: got shape \(1, 3\).*\[N \+ 1\]",
    ),
    "cu-too-short": (
        dict(cu_seqlens=X.cu_seqlens[:1]),
        ValueError,
        r"cu_seqlens: got shape \(1,\)",
    ),
    "state-shape": (
        dict(initial_state=X.initial_state[:1]),
        ValueError,
        r"initial_state: got shape \(1, 2, 128, 128\).*\(2, 2, 128, 128\)",
    ),
    "state-dtype": (
        dict(initial_state=X.initial_state.astype(np.float16)),
        TypeError,
        r"initial_state: got dtype float16",
    ),
    "scale-nan": (dict(scale=float("nan")), ValueError, r"scale: got nan.*finite"),
    "scale-inf": (dict(scale=float("inf")), ValueError, r"scale: got inf.*finite"),
    "scale-array": (dict(scale=jnp.ones(())), TypeError, r"scale: got .*Python float"),
    "backend-name": (
        dict(backend="cuda"),
        ValueError,
        r"backend: got 'cuda'.*'auto', 'xla', 'sm90'",
    ),
    "q-not-array": (dict(q=[1.0, 2.0]), TypeError, r"q: got list"),
    "final-flag": (dict(output_final_state="yes"), TypeError, r"output_final_state: got 'yes'"),
    "lb-too-low": (
        dict(gate_lower_bound=-8.0),
        ValueError,
        r"gate_lower_bound: got -8.0.*\[-5.0, 0\)",
    ),
    "lb-zero": (dict(gate_lower_bound=0.0), ValueError, r"gate_lower_bound: got 0.0"),
    "lb-type": (dict(gate_lower_bound="-5"), TypeError, r"gate_lower_bound: got str"),
    "no-heads": (dict(q=X.q[:, :0]), ValueError, r"q: got shape \(20, 0, 128\).*H >= 1"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_named(case):
    overrides, error, message = BAD[case]
    with pytest.raises(error, match=message):
        _call(**overrides)


def test_batched_form_rejects_cu_seqlens():
    q = X.q.reshape(2, 10, H, 128)
    with pytest.raises(ValueError, match=r"cu_seqlens: must be None for the batched"):
        jax_kda.prefill(
            q, q, q, X.g.reshape(q.shape), X.beta.reshape(2, 10, H), cu_seqlens=X.cu_seqlens
        )


def test_batched_form_needs_a_row():
    q = X.q[:0].reshape(0, 10, H, 128)
    with pytest.raises(ValueError, match=r"q: got shape \(0, 10, 2, 128\).*B >= 1"):
        jax_kda.prefill(q, q, q, X.g[:0].reshape(q.shape), X.beta[:0].reshape(0, 10, H))


def test_batched_state_shape_is_per_row():
    q = X.q.reshape(2, 10, H, 128)
    with pytest.raises(
        ValueError, match=r"initial_state: got shape \(1, 2, 128, 128\).*\(2, 2, 128, 128\)"
    ):
        jax_kda.prefill(
            q,
            q,
            q,
            X.g.reshape(q.shape),
            X.beta.reshape(2, 10, H),
            initial_state=X.initial_state[:1],
        )
