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
