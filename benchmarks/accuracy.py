"""Accuracy against the float64 oracle, on a sample that keeps the oracle cheap.

The sample is one whole sequence (the first non-empty one) and two heads (the first and the last):
every output of that sequence and head, its final state and, for the training step, every gradient,
including the initial state's. A whole sequence, because its final state and gradients depend on
all of its tokens; two heads at the ends of the range, to catch head indexing. The oracle runs on
the host CPU in float64 (``jax_kda.oracle.recurrent_oracle``), once per shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.inputs import Cotangents
from benchmarks.native import Native
from jax_kda.oracle import Inputs, recurrent_oracle, rms_ratio

FORWARD_OUTPUTS = ("o", "final_state")
TRAIN_OUTPUTS = ("o", "dq", "dk", "dv", "dg", "dbeta", "d_initial_state")


@dataclass(frozen=True)
class Sample:
    sequence: int
    start: int
    stop: int
    heads: tuple[int, ...]

    def describe(self) -> str:
        return (
            f"sequence {self.sequence} (tokens {self.start}:{self.stop}, all of it), "
            f"heads {list(self.heads)}"
        )

    def tokens(self, x: np.ndarray) -> np.ndarray:
        """The sample of a packed ``[T, H, ...]`` array."""
        return x[self.start : self.stop][:, list(self.heads)]

    def states(self, x: np.ndarray) -> np.ndarray:
        """The sample of an ``[N, H, V, K]`` state array, as ``[1, heads, V, K]``."""
        return x[self.sequence : self.sequence + 1][:, list(self.heads)]


def choose_sample(inputs: Inputs) -> Sample:
    cu = np.asarray(inputs.cu_seqlens)
    lengths = np.diff(cu)
    sequence = int(np.argmax(lengths > 0))
    heads = tuple(sorted({0, inputs.q.shape[1] - 1}))
    return Sample(sequence, int(cu[sequence]), int(cu[sequence + 1]), heads)


def oracle_outputs(
    inputs: Inputs, sample: Sample, cotangents: Cotangents | None
) -> dict[str, np.ndarray]:
    """The oracle's sample outputs: forward ones, and the gradients when ``cotangents`` is given."""
    token_inputs = [sample.tokens(x) for x in inputs[:5]]
    cu = np.array([0, sample.stop - sample.start])
    state = sample.states(inputs.initial_state)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        primals = [jnp.asarray(x, jnp.float64) for x in (*token_inputs, state)]

        def oracle(q, k, v, g, beta, state):
            return recurrent_oracle(q, k, v, g, beta, cu, state)

        if cotangents is None:
            o, final_state = oracle(*primals)
            return {"o": np.asarray(o), "final_state": np.asarray(final_state)}
        (o, _), pullback = jax.vjp(oracle, *primals)
        d_o = jnp.asarray(sample.tokens(cotangents.d_o), jnp.float64)
        d_final = jnp.asarray(sample.states(cotangents.d_final_state), jnp.float64)
        grads = pullback((d_o, d_final))
        return dict(zip(TRAIN_OUTPUTS, map(np.asarray, (o, *grads)), strict=True))


def packed_outputs(native: Native, inputs: Inputs, first_result) -> dict[str, np.ndarray]:
    """A step's first result in jax_kda's layouts, named as ``FORWARD_OUTPUTS`` or
    ``TRAIN_OUTPUTS`` (the step's next state is the final state or the initial-state gradient)."""
    next_state, outputs = first_result
    names = FORWARD_OUTPUTS if len(outputs) == 1 else TRAIN_OUTPUTS
    like = (inputs.q, *inputs[:5])  # o has q's shape; each gradient its input's
    packed = [np.asarray(x).reshape(ref.shape) for x, ref in zip(outputs, like, strict=False)]
    return dict(zip(names, (*packed, native.state_to_vk(np.asarray(next_state))), strict=True))


def rms_ratios(
    outputs: dict[str, np.ndarray], reference: dict[str, np.ndarray], sample: Sample
) -> dict[str, float]:
    """rms_ratio of each sampled output against the oracle's."""
    ratios = {}
    for name, ref in reference.items():
        take = sample.states if name.endswith("state") else sample.tokens
        ratios[name] = rms_ratio(take(outputs[name]), ref)
    return ratios
