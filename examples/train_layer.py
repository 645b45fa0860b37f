"""Train a KimiDeltaAttention layer with optax under jax.jit: a toy task, on the CPU in seconds.

The task needs memory beyond the short convolutions' 4 tokens: each output is a fixed linear map
of the exponentially decayed sum of all the sequence's inputs so far, y_t = sum_s 0.8^(t-s) x_s W.
The model is the layer alone (its output projection reads out); the loss is the mean squared
error, which falls to a small fraction of its start within the run.

    python examples/train_layer.py [--steps 150]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jax_kda.nn import KimiDeltaAttention

HIDDEN, HEADS, BATCH, LENGTH, DECAY = 16, 1, 8, 64, 0.8


def toy_batch(key, readout):
    """x [B, T, hidden] standard normal; y [B, T, hidden] = the decayed running sum @ readout."""
    x = jax.random.normal(key, (BATCH, LENGTH, HIDDEN))

    def accumulate(total, x_t):
        total = DECAY * total + x_t
        return total, total

    _, sums = jax.lax.scan(accumulate, jnp.zeros((BATCH, HIDDEN)), jnp.swapaxes(x, 0, 1))
    return x, jnp.swapaxes(sums, 0, 1) @ readout


def train(steps: int = 150, learning_rate: float = 3e-3, seed: int = 0) -> list[float]:
    """Train a fresh layer for `steps` steps of Adam; returns the loss of every step."""
    model = KimiDeltaAttention(HIDDEN, HEADS, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(params)
    data_key, readout_key = jax.random.split(jax.random.key(seed + 1))
    readout = jax.random.normal(readout_key, (HIDDEN, HIDDEN)) / jnp.sqrt(HIDDEN)

    def loss_fn(params, x, y):
        return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

    @jax.jit
    def step(params, opt_state, key):
        x, y = toy_batch(key, readout)
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for key in jax.random.split(data_key, steps):
        params, opt_state, loss = step(params, opt_state, key)
        losses.append(float(loss))
    return losses


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    options = parser.parse_args(argv)
    start = time.perf_counter()
    losses = train(options.steps)
    for i in range(0, len(losses), max(1, len(losses) // 6)):
        print(f"step {i:4d}  loss {losses[i]:.4f}")
    seconds = time.perf_counter() - start
    print(f"step {len(losses) - 1:4d}  loss {losses[-1]:.4f}  ({seconds:.1f} s)")


if __name__ == "__main__":
    main()
