"""benchmarks.precision_study's switch: inside it every product of jax_kda.xla takes
bfloat16-rounded operands; outside, nothing changes."""

import jax.numpy as jnp
import numpy as np

from benchmarks.precision_study import single_pass_bf16_products
from jax_kda import xla


def test_single_pass_bf16_products_round_the_operands_and_restore_the_module():
    a = jnp.asarray(np.random.default_rng(0).standard_normal(256), jnp.float32)
    exact = float(jnp.dot(a, a, precision="highest"))
    with single_pass_bf16_products():
        rounded = float(xla.jnp.einsum("i,i->", a, a))
        by_hand = a.astype(jnp.bfloat16).astype(jnp.float32)
        assert rounded == float(jnp.dot(by_hand, by_hand, precision="highest"))
    assert rounded != exact
    assert xla.jnp is jnp


def test_single_pass_bf16_products_cover_the_sm90_backends_products_too():
    from jax_kda.sm90 import backend

    with single_pass_bf16_products():
        assert backend.jnp is xla.jnp and backend.jnp is not jnp
    assert backend.jnp is jnp


def test_anchored_decayed_bwd_model_is_the_xla_backward_until_rounded():
    """The model of the kernel's anchored decayed products' backward equals the XLA path's
    blocked one in float32 on production gates, and its bf16 switches round each product kind:
    without both, --decayed-products would compare a model of something else."""
    import jax

    from benchmarks.precision_study import anchored_decayed_bwd

    rng = np.random.default_rng(4)
    shape = (3, 2, 64, 128)
    q, k = (jnp.asarray(rng.standard_normal(shape) * 0.3, jnp.float32) for _ in range(2))
    gamma = jnp.cumsum(jnp.asarray(-5.0 * rng.uniform(size=shape), jnp.float32), axis=2)
    cotangents = tuple(jnp.asarray(rng.standard_normal((3, 2, 64, 64)), jnp.float32) for _ in "ab")
    reference = jax.jit(xla._decayed_products_bwd)((q, k, gamma), cotangents)
    for bf16_p, bf16_back in ((False, False), (True, False), (False, True)):
        ours = jax.jit(anchored_decayed_bwd(bf16_p, bf16_back))((q, k, gamma), cotangents)
        for name, a, b in zip(("dq", "dk", "dgamma"), ours, reference, strict=True):
            error = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
            # dq is P(d_qk, k) alone; dk and dgamma take P(d_kk, k) and back
            touched = bf16_p if name == "dq" else bf16_p or bf16_back
            if not (bf16_p or bf16_back):
                assert error <= 1e-5, (name, error)
            elif touched:
                assert 1e-4 <= error <= 2e-2, (name, bf16_p, bf16_back, error)
            else:
                assert error <= 1e-5, (name, bf16_p, bf16_back, error)


def test_anchored_model_with_exact_diagonal_blocks_rounds_only_the_earlier_blocks():
    """exact_diagonal_blocks: cotangents inside the diagonal blocks go through float32 only, so
    with every other cotangent zero the rounded model equals the float32 one."""
    import jax

    from benchmarks.precision_study import anchored_decayed_bwd

    rng = np.random.default_rng(6)
    shape = (2, 2, 64, 128)
    q, k = (jnp.asarray(rng.standard_normal(shape) * 0.3, jnp.float32) for _ in range(2))
    gamma = jnp.cumsum(jnp.asarray(-5.0 * rng.uniform(size=shape), jnp.float32), axis=2)
    rows = np.arange(64) // 16
    same = rows[:, None] == rows[None, :]
    inside = tuple(
        jnp.asarray(np.where(same, rng.standard_normal((2, 2, 64, 64)), 0.0), jnp.float32)
        for _ in "ab"
    )
    exact = jax.jit(anchored_decayed_bwd(False, False))((q, k, gamma), inside)
    split = jax.jit(anchored_decayed_bwd(True, True, True))((q, k, gamma), inside)
    rounded = jax.jit(anchored_decayed_bwd(True, True))((q, k, gamma), inside)
    for a, b, c in zip(split, exact, rounded, strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * float(jnp.max(jnp.abs(b)))
        assert float(jnp.max(jnp.abs(c - b))) > 1e-4 * float(jnp.max(jnp.abs(b)))


def test_bf16_intermediates_model_is_the_training_structure_until_rounded():
    """bf16_intermediates with nothing rounded gives the XLA path's gradients (the training
    path's structure around stand-ins), and each switch changes them by bf16's rounding, no
    more: else --intermediates would measure something else."""
    import jax

    from benchmarks.precision_study import bf16_intermediates
    from jax_kda.oracle import long_memory_inputs, rms_ratio

    x = long_memory_inputs([130, 0, 70], 2, seed=9)
    args = (*x[:5], x.initial_state)
    w_o = np.random.default_rng(3).standard_normal(x.q.shape).astype(np.float32)

    def grads(forward):
        def loss(*a):
            o, final = forward(*a[:5], x.cu_seqlens, a[5], 0.3)
            return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(final**2)

        return jax.jit(jax.grad(loss, argnums=range(6)))(*args)

    reference = grads(lambda *a: xla.forward(*a))
    plain = grads(bf16_intermediates(False, False, False))
    for a, b in zip(plain, reference, strict=True):
        assert rms_ratio(a, b) <= 1e-5
    for options in ((True, False, False), (False, True, False), (False, False, True)):
        rounded = grads(bf16_intermediates(*options))
        worst = max(rms_ratio(a, b) for a, b in zip(rounded, reference, strict=True))
        assert 1e-6 <= worst <= 2e-2, (options, worst)
