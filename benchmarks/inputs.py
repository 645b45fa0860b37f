"""Fresh random inputs per shape: SPEC's production gate, a non-zero initial state, and (for the
training step) random cotangents. Every implementation gets the same numpy data."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from benchmarks.shapes import Shape
from jax_kda.constants import HEAD_DIM
from jax_kda.oracle import Inputs, production_inputs


class Cotangents(NamedTuple):
    """The incoming gradients of a training step: d_o [T, H, 128] bfloat16 and
    d_final_state [N, H, V, K] float32."""

    d_o: np.ndarray
    d_final_state: np.ndarray


def shape_seed(run_seed: int, shape: Shape) -> int:
    """A seed per (run, shape): fresh data every run, the same data for every implementation."""
    return int(np.random.SeedSequence([run_seed, *shape.lengths, shape.heads]).generate_state(1)[0])


def shape_inputs(shape: Shape, seed: int) -> Inputs:
    return production_inputs(shape.lengths, shape.heads, seed=seed)


def shape_cotangents(shape: Shape, seed: int) -> Cotangents:
    rng = np.random.default_rng(seed + 1)
    d_o = rng.standard_normal((shape.total_tokens, shape.heads, HEAD_DIM), np.float32)
    d_final = rng.standard_normal(
        (shape.num_sequences, shape.heads, HEAD_DIM, HEAD_DIM), np.float32
    )
    return Cotangents(np.asarray(jnp.asarray(0.1 * d_o, jnp.bfloat16)), 0.1 * d_final)
