"""The sm90 training path with saved residuals (prefill's default, residuals="saved"), its plumbing
run on the CPU: the sm90 backend's pieces are swapped for their XLA statements (the chunk core,
the state scan and every chunk's backward, sm90.differentiable_chunks around them) and the
backend check is told the kernels are there, so that the custom VJP's forward (the chunk
operands and states kept) and backward (nothing recomputed) run for real, under jit, vmap (of
grad, of jacrev, of a pullback, of vmapped pullbacks), lax.scan with checkpoint, and the batched
form. Gradients against the XLA backend's own (autodiff's residuals), or against a loop of plain
calls where a transformation of the XLA backend is itself in question."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kda
from jax_kda import sm90, xla
from jax_kda.oracle import long_memory_inputs, rms_ratio
from jax_kda.sm90 import backend

BAR = 1e-4  # float32 products on both sides; only the summation order differs


@pytest.fixture
def xla_pieces(monkeypatch):
    def chunks(num_heads, num_sequences, *, both_scans):
        del num_heads, num_sequences, both_scans
        return sm90.differentiable_chunks(sm90.xla_chunk_core, xla.state_scan, sm90.xla_chunk_bwd)

    def training_forward(q, k, v, g, beta, cu_seqlens, initial_state, scale):
        # the primal alone (a checkpointed layer's forward sweep): the same XLA pieces
        return xla.forward(
            q, k, v, g, beta, cu_seqlens, initial_state, scale,
            chunks=chunks(q.shape[1], cu_seqlens.shape[0] - 1, both_scans=False),
        )  # fmt: skip

    monkeypatch.setattr(backend, "_training_chunks", chunks)
    monkeypatch.setattr(sm90, "training_forward", training_forward)
    monkeypatch.setattr(sm90, "unavailable_reason", lambda *a: None)
    monkeypatch.setattr(sm90, "scan_unavailable_reason", lambda *a: None)


def _grads(x, backend_name, *, batched=False, vmapped=False):
    w = jnp.asarray(np.random.default_rng(3).standard_normal(x.q.shape), jnp.float32)

    def loss(q, k, v, g, beta, state):
        cu = None if batched else x.cu_seqlens
        o, final = jax_kda.prefill(
            q, k, v, g, beta, cu_seqlens=cu, initial_state=state, backend=backend_name,
            output_final_state=True,
        )  # fmt: skip
        return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(final**2)

    grad = jax.grad(loss, argnums=range(6))
    if vmapped:  # two copies of the call, scaled, as a batch

        def pair(q, k, v, g, beta, state, s):
            return grad(q * s, k, v, g, beta, state)

        scales = jnp.asarray([1.0, 0.5], x.q.dtype)
        args = (*x[:5], x.initial_state)
        return jax.jit(jax.vmap(pair, in_axes=(*[None] * 6, 0)))(*args, scales)
    return jax.jit(grad)(*x[:5], x.initial_state)


def _check(ours, ref):
    for name, a, b in zip("q k v g beta state".split(), ours, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        error = rms_ratio(a, b)
        assert error <= BAR, (name, error)


@pytest.mark.parametrize("lengths", [[130, 0, 70, 1], [0, 0]], ids=["ragged", "all-empty"])
def test_saved_residuals_give_the_xla_backends_gradients(xla_pieces, lengths):
    x = long_memory_inputs(lengths, 2, seed=11, dtype=jnp.float32)
    ours = _grads(x, "sm90")
    _check(ours, _grads(x, "xla"))


def test_saved_residuals_under_vmap_of_grad(xla_pieces):
    x = long_memory_inputs([70, 0, 64], 2, seed=12, dtype=jnp.float32)
    ours = _grads(x, "sm90", vmapped=True)
    ref = _grads(x, "xla", vmapped=True)
    assert all(a.shape[0] == 2 for a in ours)
    _check(ours, ref)


def test_saved_residuals_with_a_vmapped_pullback(xla_pieces):
    """One forward, its pullback vmapped over two cotangents: the backward runs the saved
    call once for each."""
    x = long_memory_inputs([70, 0, 64], 2, seed=13, dtype=jnp.float32)

    def pullbacks(backend_name):
        def f(q, k, v, g, beta, state):
            return jax_kda.prefill(
                q, k, v, g, beta, cu_seqlens=x.cu_seqlens, initial_state=state,
                backend=backend_name, output_final_state=True,
            )  # fmt: skip

        @jax.jit
        def run(*args):
            (o, final), pullback = jax.vjp(f, *args)
            d_o = jnp.stack([jnp.ones_like(o), -2 * jnp.ones_like(o)])
            d_final = jnp.stack([final, jnp.zeros_like(final)])
            return jax.vmap(pullback)((d_o, d_final))

        return run(*x[:5], x.initial_state)

    _check(pullbacks("sm90"), pullbacks("xla"))


def test_saved_residuals_in_scanned_checkpointed_layers_and_batched_form(xla_pieces):
    x = long_memory_inputs([64, 64], 2, seed=14, dtype=jnp.float32)
    rows = [a.reshape(2, 64, *a.shape[1:]) for a in x[:5]]

    def grads(backend_name):
        def layers(q, k, v, g, beta, state):
            @jax.checkpoint
            def body(s, _):
                o, final = jax_kda.prefill(
                    q, k, v, g, beta, initial_state=s, backend=backend_name,
                    output_final_state=True,
                )  # fmt: skip
                return final, jnp.sum(o**2)

            final, sums = jax.lax.scan(body, state, None, length=2)
            return jnp.sum(sums) + jnp.sum(final**2)

        return jax.jit(jax.grad(layers, argnums=range(6)))(*rows, x.initial_state)

    _check(grads("sm90"), grads("xla"))


def test_saved_residuals_under_vmap_of_jacrev_and_of_vmapped_pullbacks(xla_pieces):
    """Nested: vmap over calls of jacrev over two outputs (a vmapped pullback inside a vmapped
    forward), and the pullbacks of a vmapped jax.vjp vmapped again; against a loop of plain
    XLA-backend gradients, one call and one output at a time."""
    x = long_memory_inputs([70, 0, 64], 2, seed=15, dtype=jnp.float32)
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.standard_normal((2, *x.q.shape)), jnp.float32)
    scales = jnp.asarray([1.0, 0.5], jnp.float32)

    def outputs(backend_name, s):
        def f(q):
            o, final = jax_kda.prefill(
                q * s, *x[1:5], cu_seqlens=x.cu_seqlens, initial_state=x.initial_state,
                backend=backend_name, output_final_state=True,
            )  # fmt: skip
            return jnp.stack([jnp.sum(o * w[0]), jnp.sum(o * w[1]) + jnp.sum(final**2)])

        return f

    ours = jax.jit(jax.vmap(lambda s: jax.jacrev(outputs("sm90", s))(x.q)))(scales)
    one = jax.jit(lambda s, i: jax.grad(lambda q: outputs("xla", s)(q)[i])(x.q))
    ref = jnp.stack([jnp.stack([one(s, i) for i in range(2)]) for s in scales])
    assert ours.shape == ref.shape and rms_ratio(ours, ref) <= BAR, rms_ratio(ours, ref)

    @jax.jit
    def vmapped_pullbacks(scales):
        outs, pullbacks = jax.vmap(lambda s: jax.vjp(outputs("sm90", s), x.q))(scales)
        return jax.vmap(lambda pb, ct: pb(ct)[0])(pullbacks, jnp.ones_like(outs))

    ref = jnp.stack([one(s, 0) + one(s, 1) for s in scales])
    ours = vmapped_pullbacks(scales)
    assert rms_ratio(ours, ref) <= BAR, rms_ratio(ours, ref)


def test_saved_is_the_default_and_bad_values_are_named(xla_pieces, monkeypatch):
    x = long_memory_inputs([70, 0, 33], 2, seed=11)
    args = (x.q, x.k, x.v, x.g, x.beta)
    options = dict(cu_seqlens=x.cu_seqlens, initial_state=x.initial_state, backend="sm90")
    for residuals in (3, "both", None):
        with pytest.raises(ValueError, match="residuals: got"):
            jax_kda.prefill(*args, residuals=residuals, **options)
    calls = []
    original = sm90.training_residual_forward
    monkeypatch.setattr(
        sm90, "training_residual_forward", lambda *a: calls.append(1) or original(*a)
    )
    jax.grad(lambda q: jnp.sum(jax_kda.prefill(q, *args[1:], **options)[0]))(x.q)
    assert calls, "the default residuals did not run the saving forward"
    calls.clear()
    recompute = dict(options, residuals="recompute")
    jax.grad(lambda q: jnp.sum(jax_kda.prefill(q, *args[1:], **recompute)[0]))(x.q)
    assert not calls, "residuals='recompute' ran the saving forward"
