"""The JAX transformations users reach for, on the XLA backend (any machine): shard_map over
heads and over sequences with the default check_vma, explicit sharding (jax.set_mesh),
jax.export with a symbolic token count, jax.checkpoint, and jax.jvp's error; plus the opt-in
check of cu_seqlens' values."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental import checkify
from xla_env import host_devices

import jax_kda
from jax_kda.oracle import production_inputs, recurrent_oracle, rms_ratio

BAR = 1e-5  # float32 inputs: the XLA path tracks the float64 oracle to about 1e-6


def _prefill(q, k, v, g, beta, cu, state):
    return jax_kda.prefill(q, k, v, g, beta, cu_seqlens=cu, initial_state=state, backend="xla")


def test_shard_map_over_heads_and_sequences_with_check_vma():
    """Four host devices in a fresh process (the device count is fixed at JAX's start)."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        import jax_kda
        from jax_kda.oracle import production_inputs, recurrent_oracle, rms_ratio

        mesh = Mesh(np.array(jax.devices()), ("x",))
        x = production_inputs([100, 0, 30, 64], 4, seed=3, dtype=jnp.float32)
        cu = jnp.asarray(x.cu_seqlens)

        def heads(q, k, v, g, beta, state):  # every device: all tokens, one head
            return jax_kda.prefill(q, k, v, g, beta, cu_seqlens=cu, initial_state=state,
                                   backend="xla")

        spec = P(None, "x")
        by_heads = jax.shard_map(heads, mesh=mesh, in_specs=(spec,) * 6,
                                 out_specs=(spec, spec))
        ref_o, ref_final = recurrent_oracle(*x)
        o, final = jax.jit(by_heads)(*x[:5], x.initial_state)
        assert rms_ratio(o, ref_o) < 1e-5 and rms_ratio(final, ref_final) < 1e-5

        def loss(fn, *a):
            o, final = fn(*a)
            return jnp.sum(o ** 2) + jnp.sum(final ** 2)

        def plain(q, k, v, g, beta, state):
            return heads(q, k, v, g, beta, state)

        args = (*x[:5], x.initial_state)
        d_sharded = jax.jit(jax.grad(lambda *a: loss(by_heads, *a), argnums=range(6)))(*args)
        d_plain = jax.jit(jax.grad(lambda *a: loss(plain, *a), argnums=range(6)))(*args)
        for a, b in zip(d_sharded, d_plain):
            assert rms_ratio(a, b) < 1e-6

        # sequences: the batched [B, T, H, 128] form, rows sharded over the devices
        rows = production_inputs([48] * 4, 2, seed=4, dtype=jnp.float32)
        batched = [a.reshape(4, 48, *a.shape[1:]) for a in rows[:5]]

        def sequences(q, k, v, g, beta, state):
            return jax_kda.prefill(q, k, v, g, beta, initial_state=state, backend="xla")

        by_rows = jax.shard_map(sequences, mesh=mesh, in_specs=(P("x"),) * 6,
                                out_specs=(P("x"), P("x")))
        o, final = jax.jit(by_rows)(*batched, rows.initial_state)
        ref_o, ref_final = recurrent_oracle(*rows)
        assert rms_ratio(o.reshape(ref_o.shape), ref_o) < 1e-5
        assert rms_ratio(final, ref_final) < 1e-5
        d = jax.jit(jax.grad(lambda *a: loss(by_rows, *a), argnums=range(6)))(
            *batched, rows.initial_state)
        assert all(np.isfinite(np.asarray(t)).all() for t in d)
        print("ok")
        """
    )
    env = host_devices(4, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_explicit_sharding_runs_per_device():
    """Under jax.set_mesh with Explicit axes (jax.make_mesh's default), inputs sharded by rows,
    by rows and heads, by heads in the packed form (also with grouped value heads), and along
    the tokens (no per-device form: auto_axes): outputs and gradients equal the unsharded
    call's, and o and the gradients keep q's sharding."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import jax_kda
        from jax_kda.oracle import production_inputs, rms_ratio

        mesh = jax.make_mesh((2, 2), ("b", "h"))
        assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
        x = production_inputs([96] * 2, 4, seed=5, dtype=jnp.float32)
        rows = (*(a.reshape(2, 96, *a.shape[1:]) for a in x[:5]), x.initial_state)
        cu = jnp.asarray(x.cu_seqlens)

        def batched(*a):
            return jax_kda.prefill(*a[:5], initial_state=a[5], backend="xla")

        def packed(*a):
            return jax_kda.prefill(*a[:5], cu_seqlens=cu, initial_state=a[5], backend="xla")

        def loss(fn):
            def f(*a):
                o, final = fn(*a)
                return jnp.sum(o ** 2) + jnp.sum(final ** 2)
            return jax.jit(jax.grad(f, argnums=range(6)))

        cases = [  # form, q's spec, beta's, the state's, o's expected spec
            (batched, rows, P("b"), P("b"), P("b"), P("b", None, None, None)),
            (batched, rows, P("b", None, "h"), P("b", None, "h"), P("b", "h"),
             P("b", None, "h", None)),
            (batched, rows, P(None, "b"), P(None, "b"), P(), P(None, "b", None, None)),
            (packed, tuple(x[:5]) + (x.initial_state,), P(None, "h"), P(None, "h"),
             P(None, "h"), P(None, "h", None)),
        ]
        for fn, args, tok, bet, st, o_spec in cases:
            ref_o, ref_final = jax.jit(fn)(*args)
            ref_d = loss(fn)(*args)
            with jax.set_mesh(mesh):
                put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
                sharded = [put(a, tok) for a in args[:4]] + [put(args[4], bet), put(args[5], st)]
                o, final = jax.jit(fn)(*sharded)
                d = loss(fn)(*sharded)
            assert o.sharding.spec == o_spec, (o.sharding.spec, o_spec)
            assert d[0].sharding.spec == o_spec, d[0].sharding.spec
            assert rms_ratio(o, ref_o) < 1e-6 and rms_ratio(final, ref_final) < 1e-6
            for a, b in zip(d, ref_d):
                assert rms_ratio(a, b) < 1e-6

        # grouped value heads (q, k 2 heads, v, g, beta, the state 4), heads sharded: each
        # device's value heads read its own q and k heads
        xg = production_inputs([96] * 2, 4, seed=6, dtype=jnp.float32)
        grouped = (xg.q[:, ::2], xg.k[:, ::2], *xg[2:5], xg.initial_state)
        ref_o, ref_final = jax.jit(packed)(*grouped)
        ref_d = loss(packed)(*grouped)
        with jax.set_mesh(mesh):
            sharded = [jax.device_put(a, NamedSharding(mesh, P(None, "h"))) for a in grouped]
            o, final = jax.jit(packed)(*sharded)
            d = loss(packed)(*sharded)
        assert rms_ratio(o, ref_o) < 1e-6 and rms_ratio(final, ref_final) < 1e-6
        for a, b in zip(d, ref_d):
            assert rms_ratio(a, b) < 1e-6

        # a lax.scan carrying the state replicated while the rows are sharded: the final state
        # keeps the given state's type
        def chained(*a):
            def body(state, _):
                return batched(*a[:5], state)[1], None
            return jax.lax.scan(body, a[5], None, length=2)[0]

        ref = jax.jit(chained)(*rows)
        with jax.set_mesh(mesh):
            sharded = [jax.device_put(a, NamedSharding(mesh, P("b"))) for a in rows[:5]]
            state = jax.device_put(rows[5], NamedSharding(mesh, P()))
            final = jax.jit(chained)(*sharded, state)
        assert final.sharding.spec == P(None, None, None, None), final.sharding.spec
        assert rms_ratio(final, ref) < 1e-6
        print("ok")
        """
    )
    env = host_devices(4, JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_export_round_trip_with_a_symbolic_token_count():
    (tokens,) = export.symbolic_shape("T")
    heads, sequences = 2, 3
    shapes = [jax.ShapeDtypeStruct((tokens, heads, 128), jnp.float32)] * 4
    shapes += [
        jax.ShapeDtypeStruct((tokens, heads), jnp.float32),
        jax.ShapeDtypeStruct((sequences + 1,), jnp.int32),
        jax.ShapeDtypeStruct((sequences, heads, 128, 128), jnp.float32),
    ]
    blob = export.export(jax.jit(_prefill))(*shapes).serialize()
    restored = export.deserialize(blob)
    for lengths in ([100, 0, 30], [64, 64, 1]):
        x = production_inputs(lengths, heads, seed=len(lengths), dtype=jnp.float32)
        o, final = restored.call(*x)
        ref_o, ref_final = recurrent_oracle(*x)
        assert rms_ratio(o, ref_o) <= BAR and rms_ratio(final, ref_final) <= BAR, lengths


def test_checkpointed_gradients_equal_plain_ones():
    x = production_inputs([70, 9], 2, seed=5, dtype=jnp.float32)

    def loss(fn):
        def f(q, k, v, g, beta, state):
            o, final = fn(q, k, v, g, beta, x.cu_seqlens, state)
            return jnp.sum(o**2) + jnp.sum(final**2)

        return jax.jit(jax.grad(f, argnums=range(6)))(*x[:5], x.initial_state)

    for a, b in zip(loss(jax.checkpoint(_prefill)), loss(_prefill), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_jvp_raises_a_clear_error():
    """Forward mode is not served (the custom VJP defines reverse mode only); README says so."""
    x = production_inputs([20], 1, seed=6, dtype=jnp.float32)
    args = (*x[:5], x.cu_seqlens, x.initial_state)
    tangents = tuple(
        jnp.zeros_like(a) if a.dtype != np.int32 else np.zeros(a.shape, jax.dtypes.float0)
        for a in args
    )
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(_prefill, args, tangents)


@pytest.mark.parametrize(
    ("cu", "message"),
    [
        ([0, 5, 3, 9], r"cu_seqlens\[2\]: got 3 after"),
        ([1, 2, 9], r"cu_seqlens\[0\]: got 1, expected 0"),
        ([0, 4, 8], r"cu_seqlens\[2\]: got 8, expected T = 9"),
    ],
)
def test_check_cu_seqlens_names_the_first_bad_entry(cu, message):
    with pytest.raises(ValueError, match=message):
        jax_kda.check_cu_seqlens(np.array(cu, np.int32), 9)
    checked = checkify.checkify(jax.jit(lambda c: jax_kda.check_cu_seqlens(c, 9)))
    error, _ = checked(jnp.array(cu, jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match=message.replace(" after", "")):
        error.throw()


def test_check_cu_seqlens_passes_good_boundaries():
    jax_kda.check_cu_seqlens(np.array([0, 4, 4, 9], np.int32), 9)
    error, _ = checkify.checkify(jax.jit(lambda c: jax_kda.check_cu_seqlens(c, 9)))(
        jnp.array([0, 4, 4, 9], jnp.int32)
    )
    assert error.get() is None
