"""Facts every layer shares: the head dimension, the XLA path's and the backward's chunk length,
the gate bound, the default scale. The sm90 kernels' own layout facts are in
sm90/kernels/layout.py."""

HEAD_DIM = 128
"""K = V = 128: the only head dimension KDA models use and the kernels serve."""

SCAN_CHUNK = 64
"""Tokens per chunk of the XLA path and of the sm90 backward (which shares its chunk-slot layout:
sequence s owns slots cu[s] // 64 + s + c). The in-chunk decay is never factorised over more
than a block whose factors are all <= 1, so 64-token chunks are exact for any g <= 0."""


GATE_FLOOR = -100.0
"""Gates below this are taken as this: exp(-100) is about 4e-44, so the state is reset to
float32 accuracy, as g = -inf (a hard reset) asks, without an infinite cumulative sum (whose
differences would be NaN) or huge ones that swamp the small gates beside them in a chunk. The
gradient of a clamped gate is 0, as it is at -inf."""

GATE_LOWER_BOUND_MIN = -5.0
"""The most negative per-step gate the sm90 kernels serve (prefill's gate_lower_bound): over a
16-token chunk exp(-Gamma) <= e^80, inside float32's range (e^88.7)."""


def default_scale(head_dim: int = HEAD_DIM) -> float:
    return head_dim**-0.5


L2_EPS = 1e-6
"""The q/k L2 normalisation's epsilon: x * rsqrt(sum(x^2) + L2_EPS) (gate.l2_normalize, and the
chunk core's in-kernel variant)."""
