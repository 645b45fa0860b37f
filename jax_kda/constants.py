"""Facts every layer shares: the head dimension, the chunk length, the default scale."""

HEAD_DIM = 128
"""K = V = 128: the only head dimension KDA models use and the kernels serve."""

CHUNK = 16
"""Tokens per chunk of the sm90 kernels (the XLA path's are xla.XLA_CHUNK). At the production
gate (>= -5 per step) exp(-Gamma) over 16 tokens stays under e^80, inside float32's range, which
is what lets the kernels factorise the decay."""

GATE_LOWER_BOUND_MIN = -5.0
"""The most negative per-step gate the sm90 kernels serve (prefill's gate_lower_bound): over a
16-token chunk exp(-Gamma) <= e^80, inside float32's range (e^88.7)."""


def default_scale(head_dim: int = HEAD_DIM) -> float:
    return head_dim**-0.5
