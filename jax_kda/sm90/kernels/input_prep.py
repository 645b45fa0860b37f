"""prefill's in-kernel input preparation (its use_*_in_kernel flags), shared by the kernels that
load the raw inputs: the chunk core (kda_chunk_operands_sm90.py) and the gate-bound forward's
PREP (kda_fwd_sm90.py). The statements in plain JAX are jax_kda/gate.py's; the XLA path runs
those, and each kernel's GPU test holds its preparation to them."""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from jax_kda.constants import GATE_LOWER_BOUND_MIN


@dataclasses.dataclass(frozen=True)
class InputPrep:
    """prefill's in-kernel input preparation (its use_*_in_kernel flags), done by a kernel as it
    loads the inputs, so that no prepared copy of them goes through HBM:
      qk_l2norm: q and k are raw; each row becomes x * rsqrt(sum(x^2) + 1e-6) in float32, then
        bf16 (gate.l2_normalize).
      gate: g is the raw gate projection a (float32), the kernel takes a_log [HV] and dt_bias
        [HV, 128] float32 besides (HV the value heads, the grid's), and g = lower_bound *
        sigmoid(exp(a_log) * (a + dt_bias)), or with lower_bound None -exp(a_log) *
        softplus(a + dt_bias) (gate.kda_gate).
      beta_logits: beta holds logits; sigmoid(beta) is used.
      grouped_qk: q and k have H heads and the rest HV = G H (grouped value heads, fla's
        convention): value head j reads q and k head j // G, so they need no repeated copy."""

    qk_l2norm: bool = False
    gate: bool = False
    lower_bound: float | None = None
    beta_logits: bool = False
    grouped_qk: bool = False

    def __post_init__(self):
        if self.lower_bound is not None and not self.gate:
            raise ValueError("InputPrep: lower_bound is the in-kernel gate's (gate=True)")
        if self.lower_bound is not None and not GATE_LOWER_BOUND_MIN <= self.lower_bound < 0:
            raise ValueError(
                f"InputPrep: lower_bound {self.lower_bound} is outside [{GATE_LOWER_BOUND_MIN}, 0)"
            )


@cute.jit
def kda_gate(x, amplitude, lower_bound: cutlass.Constexpr):
    """gate.kda_gate of x = a + dt_bias (float32): lower_bound * sigmoid(amplitude * x), or with
    lower_bound None -amplitude * softplus(x), softplus(x) = max(x, 0) + log1p(exp(-|x|)) as
    jax.nn.softplus; precise exp and log1p (the products' exp_fast is for their own range)."""
    if cutlass.const_expr(lower_bound is None):
        result = -amplitude * (
            cute.math.max(x, Float32(0.0)) + cute.math.log1p(cute.math.exp(-cute.math.abs(x)))
        )
    else:
        result = Float32(lower_bound) / (Float32(1.0) + cute.math.exp(-(x * amplitude)))
    return result
