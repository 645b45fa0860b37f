"""jax_kda.nn.KimiDeltaAttention (needs flax: the `nn` extra, which CI installs): forms, caches,
the short convolutions' boundaries, gradients and a short training run."""

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_kda.nn
from jax_kda.nn import KDACache, KimiDeltaAttention, ShortConvolution, _packing
from jax_kda.oracle import rms_ratio

HIDDEN, HEADS = 24, 2
CACHE_BAR = 1e-5
"""A layer run in pieces through its cache against one run (float32): the same recurrence,
chunked or token by token."""


def _layer(**kwargs):
    return KimiDeltaAttention(HIDDEN, HEADS, rngs=nnx.Rngs(0), **kwargs)


@nnx.jit
def _apply(layer, x, cu_seqlens=None, cache=None):
    """The layer called under jit: one compilation instead of an eager dispatch per operation."""
    return layer(x, cu_seqlens=cu_seqlens, cache=cache)


def _x(shape, seed):
    return jax.random.normal(jax.random.key(seed), (*shape, HIDDEN))


def _cu(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def test_without_flax_the_import_error_names_the_extra():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["flax"] = None  # as if flax were not installed
        import jax_kda
        assert callable(jax_kda.decode)
        try:
            import jax_kda.nn
        except ImportError as error:
            print(error)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "jax_kda.nn needs flax" in run.stdout and "jax-kda[nn]" in run.stdout


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_shapes_and_dtypes(dtype):
    layer = _layer(dtype=dtype)
    y = _apply(layer, _x((2, 9), 0))
    assert y.shape == (2, 9, HIDDEN) and y.dtype == dtype
    y, cache = _apply(layer, _x((11,), 1), cu_seqlens=_cu([4, 0, 7]), cache=layer.init_cache(3))
    assert y.shape == (11, HIDDEN) and y.dtype == dtype
    assert cache.conv_q.shape == (3, 3, HEADS * 128) and cache.conv_q.dtype == dtype
    assert cache.state.shape == (3, HEADS, 128, 128) and cache.state.dtype == jnp.float32
    assert np.isfinite(np.asarray(y, np.float32)).all()


def test_parameters_are_initialised_as_fla_does():
    layer = _layer()
    amplitude = np.exp(np.asarray(layer.A_log[...]))
    assert amplitude.shape == (HEADS,) and ((amplitude >= 1) & (amplitude <= 16)).all()
    dt = np.asarray(jax.nn.softplus(layer.dt_bias[...]))
    assert dt.shape == (HEADS * 128,) and ((dt >= 1e-4 * 0.999) & (dt <= 0.1 * 1.001)).all()
    assert dt.min() < 3e-3 and dt.max() > 3e-2  # spread over the log-uniform range
    np.testing.assert_array_equal(np.asarray(_layer(lower_bound=-5.0).A_log[...]), 0.0)


def test_packed_form_equals_batched_rows():
    layer = _layer()
    x = _x((3, 10), 2)
    batched = _apply(layer, x)
    packed = _apply(layer, x.reshape(30, HIDDEN), cu_seqlens=_cu([10, 10, 10]))
    assert rms_ratio(packed, batched.reshape(30, HIDDEN)) <= 1e-6
    # Ragged packing against each sequence alone (an empty one among them).
    lengths = [7, 0, 13, 7]  # two lengths: two compilations of the sequences alone
    x = _x((27,), 3)
    packed = np.asarray(_apply(layer, x, cu_seqlens=_cu(lengths)))
    starts = np.cumsum([0, *lengths])
    for s, n in enumerate(lengths):
        if n:
            alone = _apply(layer, x[None, starts[s] : starts[s] + n])[0]
            assert rms_ratio(packed[starts[s] : starts[s] + n], alone) <= 1e-6


def test_convolution_does_not_leak_across_sequences():
    """Changing one sequence's tokens leaves the packed neighbours' outputs bit for bit."""
    layer = _layer()
    lengths = [6, 5, 9]
    x = _x((20,), 4)
    y = np.asarray(_apply(layer, x, cu_seqlens=_cu(lengths)))
    changed = x.at[:6].multiply(-3.0).at[6:11].add(1.0)
    y_changed = np.asarray(_apply(layer, changed, cu_seqlens=_cu(lengths)))
    np.testing.assert_array_equal(y_changed[11:], y[11:])
    assert np.abs(y_changed[:11] - y[:11]).min(axis=-1).max() > 0


def test_short_convolution_against_a_direct_sum():
    """Per sequence, y_t = silu(sum_s w[W-1-s] x_(t-s)), the inputs before the start from the
    history; the new history is the last W-1 inputs (the old history for short sequences)."""
    width, features, lengths = 4, 5, [0, 1, 2, 6]
    conv = ShortConvolution(features, width, use_bias=False, dtype=jnp.float32,
                            param_dtype=jnp.float32, rngs=nnx.Rngs(3))  # fmt: skip
    rng = np.random.default_rng(0)
    x = rng.standard_normal((sum(lengths), features)).astype(np.float32)
    history = rng.standard_normal((len(lengths), width - 1, features)).astype(np.float32)
    cu = _cu(lengths)
    y, new_history = conv(jnp.asarray(x), _packing(cu, len(x)), jnp.asarray(history))
    kernel = np.asarray(conv.kernel[...])
    for s, start in enumerate(np.asarray(cu[:-1])):
        extended = np.concatenate([history[s], x[start : start + lengths[s]]])
        for t in range(lengths[s]):
            window = extended[t : t + width]  # inputs t-3 .. t of the sequence
            want = np.sum(kernel * window, axis=0)
            want = want / (1 + np.exp(-want))
            np.testing.assert_allclose(np.asarray(y[start + t]), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(new_history[s]), extended[-(width - 1) :])


def test_prefill_in_pieces_then_decode_equals_one_prefill():
    """Batched: prefill 5 tokens, then 2 (shorter than the convolution's window), then decode
    token by token, jitted with the cache donated, against the layer on all 12 at once."""
    layer = _layer()
    x = _x((2, 12), 5)
    whole = _apply(layer, x)
    graphdef, params = nnx.split(layer)

    @jax.jit
    def run(params, x, cache):
        return nnx.merge(graphdef, params)(x, cache=cache)

    decode_step = jax.jit(run, donate_argnums=2)
    pieces, cache = [], layer.init_cache(2)
    for lo, hi in ((0, 5), (5, 7)):
        y, cache = run(params, x[:, lo:hi], cache)
        pieces.append(y)
    for t in range(7, 12):
        previous = cache
        y, cache = decode_step(params, x[:, t : t + 1], cache)
        assert previous.state.is_deleted()
        pieces.append(y)
    assert rms_ratio(jnp.concatenate(pieces, axis=1), whole) <= CACHE_BAR


def test_decode_from_a_fresh_cache_with_the_cache_donated():
    """The serving loop from its start: init_cache, then jitted one-token steps with the cache
    donated (its three histories must be separate buffers: donating one twice fails), against
    the layer on the whole sequence."""
    layer = _layer()
    x = _x((2, 4), 6)
    whole = _apply(layer, x)
    graphdef, params = nnx.split(layer)
    step = jax.jit(lambda p, x, c: nnx.merge(graphdef, p)(x, cache=c), donate_argnums=2)
    cache, pieces = layer.init_cache(2), []
    for t in range(4):
        y, cache = step(params, x[:, t : t + 1], cache)
        pieces.append(y)
    assert rms_ratio(jnp.concatenate(pieces, axis=1), whole) <= CACHE_BAR


def test_decode_takes_the_step_and_prefill_does_not(monkeypatch):
    calls = []
    for name in ("decode", "prefill"):
        original = getattr(jax_kda.nn, name)
        monkeypatch.setattr(
            jax_kda.nn, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k)
        )
    layer = _layer()
    cache = layer.init_cache(3)
    for x, kwargs in (
        (_x((3, 1), 0), dict(cache=cache)),  # one token per sequence, batched
        (_x((1,), 0), dict(cache=layer.init_cache(1))),  # one packed sequence of one token
        (_x((3, 1), 0), {}),  # no cache: prefill
        (_x((3,), 0), dict(cu_seqlens=_cu([1, 1, 1]), cache=cache)),  # packed: prefill
    ):
        jax.eval_shape(lambda x=x, kwargs=kwargs: layer(x, **kwargs))  # traced, not run
    assert calls == ["decode", "decode", "prefill", "prefill"]


def test_packed_prefill_then_batched_decode_equals_the_whole_sequences():
    layer = _layer()
    lengths, extra = [9, 0, 3], 4
    prompt = _x((12,), 6)
    more = _x((3, extra), 7)
    _, cache = _apply(layer, prompt, cu_seqlens=_cu(lengths), cache=layer.init_cache(3))
    outputs = []
    for t in range(extra):
        y, cache = _apply(layer, more[:, t : t + 1], cache=cache)
        outputs.append(y)
    outputs = jnp.concatenate(outputs, axis=1)
    starts = np.cumsum([0, *lengths])
    for s, n in enumerate(lengths):
        whole = jnp.concatenate([prompt[starts[s] : starts[s] + n], more[s]])
        assert rms_ratio(outputs[s], _apply(layer, whole[None])[0, n:]) <= CACHE_BAR


def test_lower_bound_gate_is_bounded_and_reaches_prefill(monkeypatch):
    seen = []
    original = jax_kda.nn.prefill
    monkeypatch.setattr(
        jax_kda.nn,
        "prefill",
        lambda *a, **k: seen.append(k["gate_lower_bound"]) or original(*a, **k),
    )
    layer = _layer(lower_bound=-3.0)
    f = 10.0 * jax.random.normal(jax.random.key(0), (50, HEADS, 128))
    g = np.asarray(layer._gate(f))
    assert g.min() >= -3.0 and g.max() <= 0.0
    x = _x((2, 6), 1)
    jax.eval_shape(layer, x)
    jax.eval_shape(_layer(), x)
    assert seen == [-3.0, None]
    assert np.isfinite(np.asarray(_apply(layer, x))).all()


def test_residuals_reach_prefill_and_both_give_the_same_gradients(monkeypatch):
    seen = []
    original = jax_kda.nn.prefill
    monkeypatch.setattr(
        jax_kda.nn, "prefill", lambda *a, **k: seen.append(k["residuals"]) or original(*a, **k)
    )
    x, target = _x((2, 20), 8), _x((2, 20), 9)
    grads = []
    for residuals in ("saved", "recompute"):
        layer = _layer(residuals=residuals)
        graphdef, params = nnx.split(layer, nnx.Param)

        def loss(params, graphdef=graphdef):
            return jnp.mean((nnx.merge(graphdef, params)(x) - target) ** 2)

        grads.append(jax.tree_util.tree_leaves(jax.jit(jax.grad(loss))(params)))
    assert seen == ["saved", "recompute"]
    for saved, recompute in zip(*grads, strict=True):
        np.testing.assert_allclose(np.asarray(saved), np.asarray(recompute), rtol=1e-5, atol=1e-7)


def test_gradients_are_finite_and_reach_every_parameter():
    layer = _layer(conv_bias=True)
    graphdef, params = nnx.split(layer, nnx.Param)
    x, target = _x((2, 20), 8), _x((2, 20), 9)

    @jax.jit
    def grads(params):
        def loss(params):
            return jnp.mean((nnx.merge(graphdef, params)(x) - target) ** 2)

        return jax.grad(loss)(params)

    for path, g in jax.tree_util.tree_leaves_with_path(grads(params)):
        g = np.asarray(g)
        assert np.isfinite(g).all(), path
        assert np.any(g != 0), path


BAD = {
    "head-dim": (dict(head_dim=64), ValueError, r"head_dim: got 64, expected 128"),
    "conv-size": (dict(conv_size=1), ValueError, r"conv_size: got 1"),
    "dtype": (dict(dtype=jnp.int8), TypeError, r"dtype: got int8"),
    "lower-bound": (dict(lower_bound=-8.0), ValueError, r"lower_bound: got -8.0"),
    "residuals": (dict(residuals="none"), ValueError, r"residuals: got 'none'"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_configuration_is_named(case):
    kwargs, error, message = BAD[case]
    with pytest.raises(error, match=message):
        _layer(**kwargs)


def test_bad_call_is_named():
    layer = _layer()
    with pytest.raises(ValueError, match=r"x: got shape \(2, 3, 7\).*\[B, T, 24\]"):
        layer(jnp.zeros((2, 3, 7)))
    with pytest.raises(ValueError, match=r"cu_seqlens: must be None for the batched"):
        layer(_x((1, 3), 0), cu_seqlens=_cu([3]))
    with pytest.raises(TypeError, match=r"cu_seqlens: got dtype int64, expected int32"):
        layer(_x((3,), 0), cu_seqlens=np.array([0, 3], np.int64))
    cache = layer.init_cache(2)
    with pytest.raises(ValueError, match=r"cache.conv_k: got shape \(2, 3, 256\).*\(3, 3, 256\)"):
        layer(_x((3, 1), 0), cache=cache._replace(conv_q=jnp.zeros((3, 3, 256))))
    with pytest.raises(ValueError, match=r"cache.state: got shape \(2, 2, 128, 128\)"):
        layer(_x((3, 1), 0), cache=layer.init_cache(3)._replace(state=cache.state))
    with pytest.raises(TypeError, match=r"cache: got tuple, expected a KDACache"):
        layer(_x((2, 1), 0), cache=tuple(cache))
    assert isinstance(cache, KDACache)


def test_readme_training_example_learns():
    """examples/train_layer.py as README runs it: the loss falls far below its start."""
    path = Path(__file__).parent.parent / "examples" / "train_layer.py"
    spec = importlib.util.spec_from_file_location("train_layer", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.train()
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert np.isfinite(losses).all()
    assert np.mean(losses[-10:]) < 0.2 * np.mean(losses[:5])
