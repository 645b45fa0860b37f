"""The state scan the sm90 backward is built on, checked on any machine with its XLA stand-in:
the hand-written backward (one reverse scan, the rest parallel over chunks) against JAX's
autodiff of the forward scan, and the XLA path on the same formulation against the oracle with
long-memory data (where a dropped carried or initial state fails by far)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle_gradients import float64_gradients, loss_weights
from scan_cases import scan_operands

from jax_kda import sm90, xla
from jax_kda.oracle import long_memory_inputs, recurrent_oracle, rms_ratio

LENGTH_SETS = {"ragged": [130, 0, 70], "one": [64], "empties": [0, 5, 0], "all-empty": [0, 0]}


@pytest.mark.parametrize("name", LENGTH_SETS)
def test_hand_written_scan_backward_equals_autodiff(name):
    lengths = LENGTH_SETS[name]
    args = scan_operands(lengths, 2, seed=len(name))
    rng = np.random.default_rng(7)
    states, final = xla.state_scan(*args, reverse=False)
    w_states = jnp.asarray(rng.standard_normal(states.shape), jnp.float32)
    w_final = jnp.asarray(rng.standard_normal(final.shape), jnp.float32)

    def loss(scan):
        def f(w, kd, decay, u, y0):
            s, f_ = scan(w, kd, decay, u, args[4], y0, reverse=False)
            return jnp.sum(s * w_states) + jnp.sum(f_ * w_final)

        return jax.jit(jax.grad(f, argnums=range(5)))(*args[:4], args[5])

    hand = loss(sm90.differentiable_state_scan(xla.state_scan))
    auto = loss(xla.state_scan)
    for which, a, b in zip(("w", "kd", "decay", "u", "y0"), hand, auto, strict=True):
        error = rms_ratio(a, b)
        print(f"{name} d{which}: {error:.1e}")
        assert error <= 1e-5, (which, error)
    for s, n in enumerate(lengths):
        if n == 0:  # an empty sequence passes the state and its cotangent through exactly
            np.testing.assert_array_equal(np.asarray(final[s]), np.asarray(args[5][s]))
            np.testing.assert_array_equal(np.asarray(hand[4][s]), np.asarray(w_final[s]))


def test_gap_slots_hold_zero_states():
    args = scan_operands([64, 10], 1, seed=3)  # slot 1 is a gap: sequence 1 starts at slot 2
    states, _ = xla.state_scan(*args, reverse=False)
    assert np.all(np.asarray(states[1]) == 0)
    assert np.all(np.asarray(states[0]) == np.asarray(args[5][0]))  # entering = initial state


@pytest.mark.parametrize("lengths", [[300], [130, 0, 200]])
def test_xla_path_keeps_long_memory(lengths):
    """With g near 0 the initial state and every carried state matter: a scan that dropped
    either would miss the oracle by far more than the bar."""
    x = long_memory_inputs(lengths, 2, seed=11, dtype=jnp.float32)
    o, final = jax.jit(lambda *a: xla.forward(*a, 0.3))(*x)
    ref_o, ref_final = recurrent_oracle(*x, scale=0.3)
    assert rms_ratio(o, ref_o) <= 1e-5 and rms_ratio(final, ref_final) <= 1e-5
    zero_start = x.initial_state * 0
    o_forgot, _ = jax.jit(lambda *a: xla.forward(*a, 0.3))(*x[:6], zero_start)
    assert rms_ratio(o_forgot, ref_o) > 0.1  # the data would expose a dropped state


def _xla_gradients_against_oracle(x, scale, seed):
    """Gradients of all six inputs of sum(o * w_o) + sum(final * w_f), random weights, through
    xla.forward against the float64 oracle's; asserts they agree to 1e-5 and returns ours."""
    w_o, w_f = loss_weights(x, seed)

    def loss(q, k, v, g, beta, state):
        o, final = xla.forward(q, k, v, g, beta, x.cu_seqlens, state, scale)
        return jnp.sum(o * w_o) + jnp.sum(final * w_f)

    ours = jax.jit(jax.grad(loss, range(6)))(*x[:5], x.initial_state)
    ref = float64_gradients(x, w_o, w_f, scale)
    for name, d, r in zip(("q", "k", "v", "g", "beta", "state"), ours, ref, strict=True):
        assert rms_ratio(d, r) <= 1e-5, (name, rms_ratio(d, r))
    return ours


def test_hard_reset_gate_is_exact_and_differentiable():
    """g = -inf on some channels of some tokens (mid-chunk, two in one chunk) resets those
    channels: forward and gradients match the float64 oracle, nothing is NaN."""
    x = long_memory_inputs([300, 50], 2, seed=13, dtype=jnp.float32)
    g = np.array(x.g)
    g[[70, 75, 130], :, :64] = -np.inf
    g[310, 1, :] = -np.inf
    x = x._replace(g=g)
    o, final = jax.jit(lambda *a: xla.forward(*a, 0.3))(*x)
    ref_o, ref_final = recurrent_oracle(*x, scale=0.3)
    assert rms_ratio(o, ref_o) <= 1e-5 and rms_ratio(final, ref_final) <= 1e-5
    grads = _xla_gradients_against_oracle(x, 0.3, seed=0)
    assert np.all(np.asarray(grads[3])[np.isinf(g)] == 0)


@pytest.mark.parametrize("lengths", [[130, 0, 200], [64, 10, 1]])
def test_states_formulation_equals_the_fused_one(lengths):
    """The sm90 training path's formulation (every chunk's state from the scan, outputs in
    parallel) against the XLA path's (outputs inside the scan), forward and gradients."""
    x = long_memory_inputs(lengths, 2, seed=17, dtype=jnp.float32)
    args = (*x[:5], x.initial_state)

    def run(scan):
        def loss(*a):
            o, final = xla.forward(*a[:5], x.cu_seqlens, a[5], 0.3, scan=scan)
            return jnp.sum(o**2) + jnp.sum(final**2), (o, final)

        return jax.jit(jax.value_and_grad(loss, argnums=range(6), has_aux=True))(*args)

    (_, fused_out), fused_grads = run(None)
    (_, states_out), states_grads = run(xla.state_scan)
    for a, b in zip((*fused_out, *fused_grads), (*states_out, *states_grads), strict=True):
        assert rms_ratio(a, b) <= 1e-6


@pytest.mark.parametrize("gate", [-0.05, -5.0, -30.0])
def test_chunk_operands_backward_equals_autodiff(gate):
    """The written-out backward of the per-chunk operands (the statement a per-chunk backward
    kernel implements) against JAX's autodiff of the same forward, random cotangents."""
    rng = np.random.default_rng(int(-gate * 100))
    shape = (3, 2, xla.XLA_CHUNK, 128)
    q, k = (rng.standard_normal(shape) / np.sqrt(128) for _ in range(2))
    v = 0.5 * rng.standard_normal(shape)
    g = gate / (1 + np.exp(-rng.standard_normal(shape)))
    beta = 1 / (1 + np.exp(-rng.standard_normal(shape[:3])))
    args = [jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta)]

    def plain(*a):
        return xla._chunk_operands_with_residuals(*a, 0.3)[0]

    out, pull_auto = jax.vjp(plain, *args)
    _, pull_hand = jax.vjp(lambda *a: xla._chunk_operands(*a, 0.3), *args)
    cotangents = tuple(jnp.asarray(rng.standard_normal(o.shape), jnp.float32) for o in out)
    for name, a, b in zip(
        "q k v g beta".split(), pull_hand(cotangents), pull_auto(cotangents), strict=True
    ):
        assert rms_ratio(a, b) <= 1e-5, (name, rms_ratio(a, b))


def test_single_pass_scan_operands_hold_the_bf16_values_in_image_order():
    """state_scan_operands(passes=1): A as [64 tokens, channels] and B^T as [channels, tokens]
    images of the bf16-rounded values alone, in the interleaved order (half the bytes)."""
    rng = np.random.default_rng(5)
    a = jnp.asarray(rng.standard_normal((3, 2, 64, 128)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((3, 2, 64, 128)), jnp.float32)
    add = jnp.asarray(rng.standard_normal((3, 2, 64, 128)), jnp.float32)
    run = jax.jit(sm90.state_scan_operands, static_argnums=(3, 4))
    a_img, bt_img, _ = (np.asarray(x, np.float32) for x in run(a, b, add, 16, 1))
    assert a_img.shape == bt_img.shape == (3, 2, 64 * 128)
    for img, x in ((a_img, a), (bt_img, b)):
        np.testing.assert_array_equal(
            _from_image(img, 64, 128), np.asarray(x.astype(jnp.bfloat16), np.float32)
        )
    three = np.asarray(run(a, b, add, 16, 3)[0], np.float32)
    assert three.shape == (3, 2, 2 * 64 * 128)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunk_core_wiring_gives_the_xla_paths_gradients(dtype):
    """sm90.differentiable_chunk_operands around a stand-in for the kernel (same outputs, in XLA):
    the residuals it builds, the written-out backward and the map back to tokens give the XLA
    path's gradients, in the inputs' dtypes."""
    x = long_memory_inputs([130, 0, 70, 1], 2, seed=19, dtype=dtype)
    args = (*x[:5], x.initial_state)
    w_o = np.random.default_rng(2).standard_normal(x.q.shape).astype(np.float32)

    def grads(**options):
        def loss(*a):
            o, final = xla.forward(*a[:5], x.cu_seqlens, a[5], 0.3, **options)
            return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(final**2)

        return jax.jit(jax.grad(loss, argnums=range(6)))(*args)

    wired = grads(operands=sm90.differentiable_chunk_operands(sm90.xla_chunk_core))
    for name, a, b, arg in zip("q k v g beta state".split(), wired, grads(), args, strict=True):
        assert a.dtype == arg.dtype, name
        # the same backward, but for fusion order and T^-T d[W | U] as a product with T^-1
        assert rms_ratio(a, b) <= 1e-5, (name, rms_ratio(a, b))


def test_xla_gradients_on_long_memory_data_with_a_custom_scale():
    """Every gradient against the float64 oracle where the carried and initial states matter
    (g near 0, a large initial state, several chunks) and the scale is not the default: a
    solve that dropped its far blocks, or a backward that ignored the scale, fails here."""
    x = long_memory_inputs([200, 0, 90], 2, seed=23, dtype=jnp.float32)
    _xla_gradients_against_oracle(x, 0.3, seed=3)


def _from_image(img, rows, cols):
    """Inverse of the interleaved image order (backend._interleaved_image)."""
    lead = img.shape[:-1]
    x = img.reshape(*lead, cols // 8, rows // 8, 8, 8)
    n = len(lead)
    return np.transpose(x, (*range(n), n + 1, n + 2, n, n + 3)).reshape(*lead, rows, cols)


def test_tensor_core_scan_operands():
    """state_scan_operands: A as [64 tokens, hi | lo channels] and B^T as [hi | lo tokens, K]
    images in wgmma's interleaved order, bf16, with hi + lo = x to about 2^-16 under jit (a
    rounding f32 -> bf16 -> f32 round trip that XLA dropped would leave lo = 0 and bf16's
    2^-9); the addend as contiguous V slices."""
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.standard_normal((3, 2, 64, 128)) * 10.0 ** rng.integers(-3, 3), jnp.float32)
    b = jnp.asarray(rng.standard_normal((3, 2, 64, 128)), jnp.float32)
    add = jnp.asarray(rng.standard_normal((3, 2, 128, 128)), jnp.float32)
    a_img, bt_img, slices = jax.jit(sm90.state_scan_operands, static_argnums=3)(a, b, add, 32)
    assert a_img.shape == bt_img.shape == (3, 2, 16384) and a_img.dtype == jnp.bfloat16
    a_img = _from_image(np.asarray(a_img, np.float64), 64, 256)
    bt_img = _from_image(np.asarray(bt_img, np.float64), 128, 128)
    a_back = a_img[..., :128] + a_img[..., 128:]
    b_back = bt_img[..., :64, :] + bt_img[..., 64:, :]
    for x, back in ((a, a_back), (b, b_back)):
        x = np.asarray(x, np.float64)
        assert np.all(np.abs(back - x) <= 2.0**-16 * np.abs(x))
        assert np.linalg.norm(back - x) / np.linalg.norm(x) < 2.0**-17
    # the image order itself: element (m, k) of a K-major image at (k//8)*512 + (m//8)*64 + ...
    a_raw = np.asarray(jax.jit(sm90.state_scan_operands, static_argnums=3)(a, b, add, 32)[0])
    a_hi = np.asarray(a.astype(jnp.bfloat16), np.float64)  # truncation and rounding agree
    m, k = 13, 77
    at = (k // 8) * 512 + (m // 8) * 64 + (m % 8) * 8 + k % 8
    assert abs(float(a_raw[0, 0, at]) - a_hi[0, 0, m, k]) <= 2.0**-8 * abs(a_hi[0, 0, m, k])
    slices = np.asarray(slices)
    assert slices.shape == (3, 2, 4, 128 * 32)
    np.testing.assert_array_equal(slices[1, 0, 2].reshape(128, 32), np.asarray(add)[1, 0, :, 64:96])


@pytest.mark.parametrize("v_slice", [16, 32])
def test_sliced_addend_is_taken_as_it_is_or_put_back(v_slice):
    """An addend that comes as SlicedAddend (state_cotangent_kernel's, for the reverse scan):
    the tensor-core scan of its width takes its slices as they are (no copy in XLA), one of the
    other width gets the same slices it would get from the plain addend, and the SIMT scans'
    plain [slots, H, rows, V] comes back exactly."""
    rng = np.random.default_rng(v_slice)
    a = jnp.asarray(rng.standard_normal((3, 2, 64, 128)), jnp.float32)
    add = jnp.asarray(rng.standard_normal((3, 2, 128, 128)), jnp.float32)
    plain = {vs: sm90.state_scan_operands(a, a, add, vs, 1)[2] for vs in (16, 32)}
    sliced = sm90.SlicedAddend(plain[v_slice], v_slice)
    assert sm90.state_scan_operands(a, a, sliced, v_slice, 1)[2] is sliced.slices
    other = 48 - v_slice
    np.testing.assert_array_equal(sm90.state_scan_operands(a, a, sliced, other, 1)[2], plain[other])
    np.testing.assert_array_equal(sm90.backend._unsliced(sliced), add)


def test_tokens_bwd_kernel_with_no_slots_returns_zeros_without_a_launch():
    """No tokens and no sequences: tokens_bwd_kernel returns zero gradients of the tokens'
    shapes (no kernel call: an empty grid cannot launch)."""
    tokens = (*(jnp.zeros((0, 3, 128), jnp.bfloat16) for _ in range(3)), jnp.zeros((0, 3, 128)))
    tokens += (jnp.zeros((0, 3)),)  # q, k, v, g, beta
    chunk = jnp.zeros((0, 3, 64, 128), jnp.float32)
    wide = jnp.zeros((0, 3, 64, 256), jnp.float32)
    cotangents = (wide, jnp.zeros((0, 3, 64)), chunk, chunk, jnp.zeros((0, 3, 128)))
    out = sm90.tokens_bwd_kernel(
        0.3, tokens, jnp.zeros((1,), jnp.int32), None, chunk, (chunk, chunk, chunk), cotangents
    )
    assert [a.shape for a in out] == [(0, 3, 128)] * 4 + [(0, 3)]
    assert [a.dtype for a in out] == [jnp.bfloat16] * 3 + [jnp.float32] * 2


def test_chunk_core_scan_image_offsets_are_the_scans_image_order():
    """chunk_io.scan_order_offset (where the chunk core writes W and Kd's bf16 scan images)
    against state_scan_operands' single-pass image of the same [64, 128] array: every element
    at its offset, once; scan_order_position (where the other kernels read 16-byte pieces of
    those images) is its inverse; backend.chunk_rows puts an image back into rows."""
    from jax_kda.sm90.kernels.chunk_io import scan_order_offset, scan_order_position

    x = np.arange(64 * 128, dtype=np.float32).reshape(1, 1, 64, 128)  # element ids
    ids = jnp.asarray(x)
    image = np.asarray(sm90.backend._interleaved_image(ids))[0, 0]
    offsets = np.array([[scan_order_offset(i, c) for c in range(128)] for i in range(64)])
    assert sorted(offsets.ravel().tolist()) == list(range(64 * 128))
    np.testing.assert_array_equal(image[offsets], x[0, 0])
    for o in range(0, 64 * 128, 8):  # each 16-byte piece: 8 neighbouring columns of one row
        i, c = scan_order_position(o)
        assert c % 8 == 0 and [scan_order_offset(i, c + e) for e in range(8)] == list(
            range(o, o + 8)
        )
    small = jnp.asarray(np.random.default_rng(0).integers(-100, 100, (2, 3, 64, 128)), jnp.float32)
    packed = sm90.backend.chunk_image(small)  # integers: exact in bf16
    assert packed.shape == (2, 3, 64 * 128) and packed.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(sm90.backend.chunk_rows(packed)), np.asarray(small))
    decay = jnp.ones((2, 3, 128), jnp.bfloat16)  # not an image: only cast
    assert sm90.backend.chunk_rows(decay).shape == (2, 3, 128)


def test_gate_floor_grad_is_the_vjp_of_the_floor():
    """xla.gate_floor_grad (what xla_tokens_bwd and the tokens-backward kernel apply to dg, now
    that the sm90 training path takes g unfloored) against jax.vjp of jnp.maximum(g, floor):
    whole above the floor, half at it, none below it or at NaN."""
    from jax_kda.constants import GATE_FLOOR

    g = jnp.asarray([0.0, -3.0, GATE_FLOOR, -100.5, -300.0, -jnp.inf, jnp.nan, GATE_FLOOR + 1e-5])
    dg = jnp.arange(1.0, 9.0)
    expected = jax.vjp(lambda x: jnp.maximum(x, GATE_FLOOR), g)[1](dg)[0]
    np.testing.assert_array_equal(xla.gate_floor_grad(g, dg), expected)
    np.testing.assert_array_equal(expected, [1, 2, 1.5, 0, 0, 0, 0, 8])


def _xla_both_scans(w, kd, decay, u, d_states, cu_seqlens, y0, d_final):
    """sm90.state_scans_kernel's contract in XLA: the forward scan and the reverse one."""
    states, final = xla.state_scan(w, kd, decay, u, cu_seqlens, y0, reverse=False)
    g_end, d_y0 = xla.state_scan(kd, w, decay, d_states, cu_seqlens, d_final, reverse=True)
    return states, final, g_end, d_y0


@pytest.mark.parametrize("both_scans", [False, True], ids=["states-saved", "both-scans"])
@pytest.mark.parametrize("floor", [False, True], ids=["long-memory", "gate-floor"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunks_wiring_gives_the_xla_paths_gradients(dtype, floor, both_scans):
    """sm90.differentiable_chunks (the chunk core, the state scan and the outputs around them as
    one custom VJP: the reverse scan, then every chunk's backward) around XLA stand-ins for the
    kernels (xla_chunk_core, xla.state_scan, xla_chunk_bwd): the XLA path's gradients, in the
    inputs' dtypes, on long-memory data, where the states carried between chunks and the
    initial state matter. A backward that dropped the outputs' part of dU, or of the state's
    cotangent, fails here. With gate-floor, some gates are -inf, -300 or exactly the floor
    (-100): differentiable_chunks applies the floor itself (xla.forward leaves g to it; without
    it the -inf gates give inf). The floor's rule for dg is invisible here (the decay there is
    e^-100): test_gate_floor_grad_is_the_vjp_of_the_floor checks it. both-scans: the backward
    scans the chunk states again beside the reverse scan (the states are no residual)."""
    x = long_memory_inputs([130, 0, 70, 1], 2, seed=31, dtype=dtype)
    if floor:
        g = np.array(x.g)
        g[::5, :, ::3], g[1::7, :, 1::4], g[2::9, :, 2::5] = -np.inf, -300.0, -100.0
        x = x._replace(g=g)
    args = (*x[:5], x.initial_state)
    w_o = np.random.default_rng(6).standard_normal(x.q.shape).astype(np.float32)
    w_f = np.random.default_rng(7).standard_normal(x.initial_state.shape).astype(np.float32)

    def grads(**options):
        def loss(*a):
            o, final = xla.forward(*a[:5], x.cu_seqlens, a[5], 0.3, **options)
            return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(final * w_f)

        return jax.jit(jax.grad(loss, argnums=range(6)))(*args)

    calls = []

    def chunk_bwd(scale, tokens, *rest):
        calls.append([t.shape for t in tokens])  # what the forward saved: the tokens themselves
        return sm90.xla_chunk_bwd(scale, tokens, *rest)

    chunks = sm90.differentiable_chunks(
        sm90.xla_chunk_core, xla.state_scan, chunk_bwd,
        both_scans=_xla_both_scans if both_scans else None,
    )  # fmt: skip
    wired = grads(chunks=chunks)
    assert calls == [[x.q.shape, x.k.shape, x.v.shape, x.g.shape, x.beta.shape]], calls
    # bfloat16 gradients round at 2^-9: a changed summation order flips a few roundings
    bar = 1e-5 if dtype == jnp.float32 else 1e-4
    for name, a, b, arg in zip("q k v g beta state".split(), wired, grads(), args, strict=True):
        assert a.dtype == arg.dtype, name
        assert rms_ratio(a, b) <= bar, (name, rms_ratio(a, b))


def test_xla_dense_products_bwd_is_the_vjp_of_the_products_it_replaces():
    """xla_dense_products_bwd against jax.vjp of O = Qg S + Aqk (U - W S) and S' = Diag(a) S + Kd^T
    (U - W S) chunk by chunk (each chunk's S given): every cotangent, with the scan's G standing
    in for dL/dS'."""
    rng = np.random.default_rng(8)
    shape = (3, 2, 64, 128)

    def f32(*s):
        return jnp.asarray(rng.standard_normal(s), jnp.float32)

    w, u, qg, kd, d_out = (f32(*shape) for _ in range(5))
    attn, states, g_end = f32(3, 2, 64, 64), f32(3, 2, 128, 128), f32(3, 2, 128, 128)
    decay = jnp.asarray(rng.uniform(0.1, 1.0, (3, 2, 128)), jnp.float32)
    hi = jax.lax.Precision.HIGHEST

    def products(w, u, qg, attn, kd, decay, states):
        v_new = u - jnp.einsum("shik,shkv->shiv", w, states, precision=hi)
        out = jnp.einsum("shik,shkv->shiv", qg, states, precision=hi)
        out = out + jnp.einsum("shij,shjv->shiv", attn, v_new, precision=hi)
        nxt = decay[..., None] * states + jnp.einsum("shik,shiv->shkv", kd, v_new, precision=hi)
        return out, nxt

    _, pull = jax.vjp(products, w, u, qg, attn, kd, decay, states)
    d_w, d_u, d_qg, d_attn, d_kd, d_decay, _ = pull((d_out, g_end))
    got = sm90.xla_dense_products_bwd(w, u, attn, kd, states, g_end, d_out)
    want = (d_w, d_u, d_qg, d_attn, d_kd, d_decay)
    for name, a, b in zip("d_w d_u d_qg d_attn d_kd d_decay".split(), got, want, strict=True):
        assert rms_ratio(a, b) <= 1e-5, (name, rms_ratio(a, b))
