"""The HBM floor: the time the bytes that must move take at the H200's bandwidth."""

from __future__ import annotations

from jax_kda.constants import HEAD_DIM

HBM_BYTES_PER_SECOND = 4.8e12
"""H200 HBM3e bandwidth (SPEC's anchor table uses the same figure)."""

_BF16, _F32, _INT32 = 2, 4, 4
STATE_BYTES = HEAD_DIM * HEAD_DIM * _F32
"""One [128, 128] float32 state of a (sequence, head)."""


def _token_bytes(token_heads: int, qkv_bytes: int) -> int:
    """q, k, v (qkv_bytes an element), g (f32), beta (f32) read once, o (q's dtype) written once."""
    qkv = 3 * token_heads * HEAD_DIM * qkv_bytes
    gate = token_heads * HEAD_DIM * _F32
    beta = token_heads * _F32
    out = token_heads * HEAD_DIM * qkv_bytes
    return qkv + gate + beta + out


def hbm_floor_bytes(total_tokens: int, heads: int, num_sequences: int) -> int:
    """Bytes a forward call must move: the tokens' inputs and outputs (bf16 q, k, v, o), the
    [128, 128] f32 states read and written once per (sequence, head)."""
    states = 2 * num_sequences * heads * STATE_BYTES
    return _token_bytes(total_tokens * heads, _BF16) + states


def hbm_floor_us(total_tokens: int, heads: int, num_sequences: int) -> float:
    return hbm_floor_bytes(total_tokens, heads, num_sequences) / HBM_BYTES_PER_SECOND * 1e6


def decode_bytes(num_sequences: int, heads: int, *, qkv_bytes: int = _BF16, pooled: bool) -> int:
    """Bytes one decode step must move: a token per sequence in and out, each (sequence, head)
    state read and written once (a pool's other rows are not touched), and the int32 index per
    sequence when the states come from a pool."""
    states = 2 * num_sequences * heads * STATE_BYTES
    indices = num_sequences * _INT32 if pooled else 0
    return _token_bytes(num_sequences * heads, qkv_bytes) + states + indices


def decode_floor_us(num_sequences: int, heads: int, *, qkv_bytes: int = _BF16, pooled: bool):
    bytes_moved = decode_bytes(num_sequences, heads, qkv_bytes=qkv_bytes, pooled=pooled)
    return bytes_moved / HBM_BYTES_PER_SECOND * 1e6
