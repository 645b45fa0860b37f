"""Flax NNX layer: ``KimiDeltaAttention``, the KDA token mixer of Kimi Linear style models.

Its parts follow fla's ``fla/layers/kda.py``: q, k, v projections; short causal depthwise
convolutions with SiLU; q and k L2-normalised per head; the gate from a low-rank projection
(hidden -> 128 -> H * 128) through ``-exp(A_log) * softplus(. + dt_bias)``, or the bounded
"safe" gate ``lower_bound * sigmoid(exp(A_log) * (. + dt_bias))`` when ``lower_bound`` is set;
beta = sigmoid of a projection; the recurrence (``jax_kda.prefill``, or ``jax_kda.decode`` for
one token per sequence with a cache); a gated RMSNorm (``norm(o) * sigmoid(gate)``, the gate
from a low-rank projection) and the output projection.

Needs flax (the ``nn`` extra: ``pip install 'jax-kda[nn]'``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

try:
    from flax import nnx
except ImportError as error:  # flax is an optional dependency
    raise ImportError(
        "jax_kda.nn needs flax, which is not installed: pip install 'jax-kda[nn]' (the 'nn' "
        "extra: flax and optax)"
    ) from error

from jax_kda.api import (
    RESIDUALS,
    _describe,
    _require_array,
    _validate_cu_seqlens,
    _validate_state,
    prefill,
)
from jax_kda.constants import HEAD_DIM
from jax_kda.decode_step import decode
from jax_kda.gate import check_lower_bound, kda_gate, l2_normalize

_COMPUTE_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


class KDACache(NamedTuple):
    """What a layer carries from one call to the next, per sequence.

    conv_q, conv_k, conv_v: [N, conv_size - 1, H * 128] in the layer's dtype, the last inputs of
      each short convolution, oldest first (zeros before a sequence's first token).
    state: [N, H, 128, 128] float32, the recurrent state stored transposed ([V, K]).
    """

    conv_q: jax.Array
    conv_k: jax.Array
    conv_v: jax.Array
    state: jax.Array


class _Packing(NamedTuple):
    """Where each packed token sits: its sequence and its index in it ([T] int32 each), and
    each sequence's first token and length ([N] int32 each)."""

    sequence: jax.Array
    position: jax.Array
    starts: jax.Array
    lengths: jax.Array


def _packing(cu_seqlens, total_tokens: int) -> _Packing:
    tokens = jnp.arange(total_tokens, dtype=jnp.int32)
    # Right of equal boundaries: a token at an empty sequence's boundary belongs to the next.
    sequence = jnp.searchsorted(cu_seqlens[1:], tokens, side="right").astype(jnp.int32)
    starts = cu_seqlens[:-1]
    return _Packing(sequence, tokens - starts[sequence], starts, cu_seqlens[1:] - starts)


class ShortConvolution(nnx.Module):
    """Causal depthwise convolution over each sequence's tokens, then SiLU:
    y_t = silu(bias + sum_{s < W} kernel[W - 1 - s] * x_{t - s}), with x before a sequence's
    first token taken from its history (the cache) or zero: nothing crosses sequences."""

    def __init__(self, features: int, kernel_size: int, *, use_bias: bool, dtype, param_dtype,
                 rngs: nnx.Rngs):  # fmt: skip
        # PyTorch's Conv1d default for a depthwise kernel: uniform in +-1/sqrt(kernel_size).
        bound = 1.0 / math.sqrt(kernel_size)
        kernel = jax.random.uniform(
            rngs.params(), (kernel_size, features), param_dtype, -bound, bound
        )
        self.kernel = nnx.Param(kernel)
        self.bias = nnx.Param(jnp.zeros((features,), param_dtype)) if use_bias else None
        self.kernel_size = kernel_size
        self.dtype = dtype

    def __call__(self, x, packing: _Packing, history=None):
        """x: [T, D] packed tokens; history: [N, W - 1, D] or None (zeros). Returns (y [T, D],
        the new history [N, W - 1, D]: each sequence's last W - 1 inputs, history included)."""
        width = self.kernel_size
        kernel = self.kernel[...].astype(self.dtype)
        x = x.astype(self.dtype)
        padded = jnp.concatenate([jnp.zeros((width - 1, x.shape[1]), x.dtype), x])
        total = x.shape[0]
        y = jnp.zeros_like(x)
        for lag in range(width):
            shifted = padded[width - 1 - lag : width - 1 - lag + total]
            inside = (packing.position >= lag)[:, None]
            if history is None or lag == 0:
                earlier = jnp.zeros_like(x)
            else:  # lag - position steps before the start: history row W - 1 - (lag - position)
                row = jnp.clip(width - 1 - lag + packing.position, 0, width - 2)
                earlier = history[packing.sequence, row]
            y = y + kernel[width - 1 - lag] * jnp.where(inside, shifted, earlier)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return jax.nn.silu(y), self._history(padded, packing, history)

    def _history(self, padded, packing: _Packing, history):
        width = self.kernel_size
        # Position p = length - (W - 1) + j of each sequence, for j = 0 .. W - 2.
        offsets = jnp.arange(width - 1, dtype=jnp.int32) - (width - 1)
        position = packing.lengths[:, None] + offsets  # [N, W - 1]
        from_tokens = padded[packing.starts[:, None] + position + width - 1]
        if history is None:
            earlier = jnp.zeros_like(from_tokens)
        else:
            earlier = jnp.take_along_axis(
                history, jnp.clip(width - 1 + position, 0, width - 2)[..., None], axis=1
            )
        return jnp.where((position >= 0)[..., None], from_tokens, earlier)


class GatedRMSNorm(nnx.Module):
    """RMSNorm over the head dim, times sigmoid(gate), in float32 (fla's FusedRMSNormGated
    with the sigmoid activation): x * rsqrt(mean(x^2) + eps) * scale * sigmoid(gate)."""

    def __init__(self, features: int, *, eps: float, param_dtype):
        self.scale = nnx.Param(jnp.ones((features,), param_dtype))
        self.eps = eps

    def __call__(self, x, gate):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        gated = normed * self.scale[...].astype(jnp.float32)
        return (gated * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)


class KimiDeltaAttention(nnx.Module):
    """Kimi Delta Attention layer (fla's ``KimiDeltaAttention`` structure), on jax_kda's kernels.

    Args:
      hidden_size: the model width.
      num_heads: H; the layer's key and value widths are H * 128.
      head_dim: must be 128 (the only head dim KDA kernels serve).
      conv_size: the short convolutions' kernel size (4).
      conv_bias: whether the short convolutions have a bias.
      lower_bound: None: fla's gate g = -exp(A_log) * softplus(f + dt_bias), any g <= 0. A
        float in [-5, 0): the safe gate lb * sigmoid(exp(A_log) * (f + dt_bias)), in [lb, 0),
        passed to prefill as gate_lower_bound (on Hopper, the fast forward).
      norm_eps: the gated RMSNorm's epsilon.
      dtype: the activations' dtype (projections, convolutions, q, k, v, o): bfloat16, float16
        or float32; the sm90 kernels take bfloat16 only (others run the XLA path).
      param_dtype: the parameters' dtype.
      backend: prefill's backend ("auto", "xla", "sm90").
      residuals: prefill's residuals ("saved": the training forward keeps what the backward
        needs; "recompute": less memory, the backward recomputes it).
      rngs: nnx.Rngs for the initialisation.

    Parameters as fla initialises them: A_log = log(uniform(1, 16)) per head (0 with
    lower_bound), dt_bias the inverse softplus of dt, log-uniform in [1e-3, 0.1], per channel.
    fla's grouped values (num_v_heads), expand_v and allow_neg_eigval are not offered.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        head_dim: int = HEAD_DIM,
        conv_size: int = 4,
        conv_bias: bool = False,
        lower_bound: float | None = None,
        norm_eps: float = 1e-5,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        backend: str = "auto",
        residuals: str = "saved",
        rngs: nnx.Rngs,
    ):
        if head_dim != HEAD_DIM:
            raise ValueError(f"head_dim: got {head_dim}, expected {HEAD_DIM} (the only one served)")
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: got {value!r}, expected a positive int")
        if isinstance(conv_size, bool) or not isinstance(conv_size, int) or conv_size < 2:
            raise ValueError(f"conv_size: got {conv_size!r}, expected an int >= 2")
        if jnp.dtype(dtype) not in _COMPUTE_DTYPES:
            raise TypeError(f"dtype: got {jnp.dtype(dtype)}, expected bfloat16, float16 or float32")
        if lower_bound is not None:
            check_lower_bound(lower_bound)
        if residuals not in RESIDUALS:
            raise ValueError(f"residuals: got {residuals!r}, expected one of {RESIDUALS}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.conv_size = conv_size
        self.lower_bound = lower_bound
        self.dtype = dtype
        self.backend = backend
        self.residuals = residuals
        width = num_heads * HEAD_DIM

        def linear(features_in, features_out, use_bias=False):
            return nnx.Linear(features_in, features_out, use_bias=use_bias, dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs)  # fmt: skip

        def conv():
            return ShortConvolution(width, conv_size, use_bias=conv_bias, dtype=dtype,
                                    param_dtype=param_dtype, rngs=rngs)  # fmt: skip

        self.q_proj, self.k_proj, self.v_proj = (linear(hidden_size, width) for _ in range(3))
        self.q_conv, self.k_conv, self.v_conv = conv(), conv(), conv()
        # Low rank, as fla: hidden -> head_dim -> H * 128, for the gate and the output gate.
        self.f_proj = nnx.Sequential(linear(hidden_size, HEAD_DIM), linear(HEAD_DIM, width))
        self.g_proj = nnx.Sequential(
            linear(hidden_size, HEAD_DIM), linear(HEAD_DIM, width, use_bias=True)
        )
        self.b_proj = linear(hidden_size, num_heads)
        if lower_bound is None:
            a = jax.random.uniform(rngs.params(), (num_heads,), jnp.float32, 1.0, 16.0)
            self.A_log = nnx.Param(jnp.log(a).astype(param_dtype))
        else:
            self.A_log = nnx.Param(jnp.zeros((num_heads,), param_dtype))
        low, high = math.log(1e-3), math.log(0.1)
        dt = jnp.exp(jax.random.uniform(rngs.params(), (width,), jnp.float32, low, high))
        dt = jnp.maximum(dt, 1e-4)
        self.dt_bias = nnx.Param((dt + jnp.log(-jnp.expm1(-dt))).astype(param_dtype))
        self.o_norm = GatedRMSNorm(HEAD_DIM, eps=norm_eps, param_dtype=param_dtype)
        self.o_proj = linear(width, hidden_size)

    def init_cache(self, num_sequences: int) -> KDACache:
        """An empty cache (zero histories and states) for num_sequences sequences."""
        width = self.num_heads * HEAD_DIM
        shape = (num_sequences, self.conv_size - 1, width)
        # three separate buffers, so that a jitted step can donate the cache
        histories = [jnp.zeros(shape, self.dtype) for _ in range(3)]
        state = jnp.zeros((num_sequences, self.num_heads, HEAD_DIM, HEAD_DIM), jnp.float32)
        return KDACache(*histories, state)

    def __call__(self, x, *, cu_seqlens=None, cache: KDACache | None = None):
        """Args:
          x: [B, T, hidden_size] (one sequence per row) or [T, hidden_size] packed, any float.
          cu_seqlens: with the packed form, [N + 1] int32 boundaries (None: one sequence).
          cache: None, or a KDACache of the N sequences (init_cache(N) to start them): the
            convolutions continue from its histories and the recurrence from its states. With
            one token per sequence (x [B, 1, hidden], or [1, hidden] without cu_seqlens) the
            recurrence is jax_kda.decode, else prefill.
        Returns:
          y in x's shape (the layer's dtype); with a cache, (y, the updated cache).
        """
        batched = self._check(x, cu_seqlens, cache)
        if batched:
            rows, length = x.shape[:2]
            tokens = x.reshape(rows * length, x.shape[2])
            cu = jnp.arange(rows + 1, dtype=jnp.int32) * length
        else:
            tokens, length = x, x.shape[0]
            cu = jnp.array([0, length], jnp.int32) if cu_seqlens is None else cu_seqlens
        one_token_each = cache is not None and length == 1 and (batched or cu_seqlens is None)
        packing = _packing(cu, tokens.shape[0])
        heads = (tokens.shape[0], self.num_heads, HEAD_DIM)

        h = tokens.astype(self.dtype)
        histories = (None, None, None) if cache is None else cache[:3]
        q, conv_q = self.q_conv(self.q_proj(h), packing, histories[0])
        k, conv_k = self.k_conv(self.k_proj(h), packing, histories[1])
        v, conv_v = self.v_conv(self.v_proj(h), packing, histories[2])
        q, k = l2_normalize(q.reshape(heads)), l2_normalize(k.reshape(heads))
        v = v.reshape(heads)
        g = self._gate(self.f_proj(h).reshape(heads))
        beta = jax.nn.sigmoid(self.b_proj(h).astype(jnp.float32))
        state = None if cache is None else cache.state
        if one_token_each:
            o, state = decode(q, k, v, g, beta, state)
        else:
            o, state = prefill(
                q, k, v, g, beta, cu_seqlens=cu, initial_state=state,
                output_final_state=cache is not None, gate_lower_bound=self.lower_bound,
                backend=self.backend, residuals=self.residuals,
            )  # fmt: skip
        o = self.o_norm(o, self.g_proj(h).reshape(heads))
        y = self.o_proj(o.reshape(tokens.shape[0], self.num_heads * HEAD_DIM))
        y = y.reshape(*x.shape[:-1], self.hidden_size)
        return y if cache is None else (y, KDACache(conv_q, conv_k, conv_v, state))

    def _gate(self, f):
        """f: [T, H, 128] -> g float32 <= 0."""
        return kda_gate(f, self.A_log[...], self.dt_bias[...], lower_bound=self.lower_bound)

    def _check(self, x, cu_seqlens, cache) -> bool:
        """Shapes of the call's arguments; True for the batched form."""
        _require_array("x", x)
        if x.ndim not in (2, 3) or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"x: got {_describe(x)}, expected [B, T, {self.hidden_size}] or packed "
                f"[T, {self.hidden_size}]"
            )
        batched = x.ndim == 3
        if batched:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens: must be None for the batched [B, T, hidden] form")
            sequences = x.shape[0]
        else:
            sequences = 1 if cu_seqlens is None else _validate_cu_seqlens(cu_seqlens)
        if cache is None:
            return batched
        if not isinstance(cache, KDACache):
            raise TypeError(f"cache: got {type(cache).__name__}, expected a KDACache")
        history = (sequences, self.conv_size - 1, self.num_heads * HEAD_DIM)
        for name in ("conv_q", "conv_k", "conv_v"):
            got = getattr(cache, name)
            if tuple(got.shape) != history:
                raise ValueError(f"cache.{name}: got {_describe(got)}, expected shape {history}")
        _validate_state("cache.state", cache.state, sequences, self.num_heads)
        return batched
