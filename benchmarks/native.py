"""What every adapter hands the harness: an implementation bound to one shape's inputs.

The harness's common layouts are jax_kda's: tokens packed ``[T, H, ...]``, states ``[N, H, V, K]``.
An adapter keeps the inputs in its own layouts (so the timed calls pay no conversion) and says how
to map its outputs back for the accuracy check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


class Unavailable(Exception):
    """The implementation cannot serve this call here; the message says why."""


@dataclass
class Native:
    """One implementation bound to one shape, inputs already on the device in its layouts.

    framework: "jax" or "torch" (which measurement and step builders apply).
    args: the token inputs ``q, k, v, g, beta`` plus anything the call needs (``cu_seqlens``).
    initial_state: the state in the implementation's layout.
    call: ``call(args, state) -> (o, final_state)``, traceable by ``jax.jit`` for "jax".
    state_is_kv: True when the implementation stores the state ``[K, V]`` (not ``[V, K]``).
    notes: how the adapter calls the implementation (recorded in the results).
    """

    framework: str
    args: dict[str, Any]
    initial_state: Any
    call: Callable[[dict[str, Any], Any], tuple[Any, Any]]
    state_is_kv: bool
    notes: str

    def state_to_vk(self, state: np.ndarray) -> np.ndarray:
        return np.swapaxes(state, -1, -2) if self.state_is_kv else state

    def state_from_vk(self, state: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.state_to_vk(state))
