"""The HBM floor: the time the bytes that must move take at the H200's bandwidth."""

from __future__ import annotations

from jax_kda.constants import HEAD_DIM

HBM_BYTES_PER_SECOND = 4.8e12
"""H200 HBM3e bandwidth (SPEC's anchor table uses the same figure)."""

_BF16, _F32 = 2, 4


def hbm_floor_bytes(total_tokens: int, heads: int, num_sequences: int) -> int:
    """Bytes a forward call must move: q, k, v (bf16), g (f32), beta (f32) read once, o (bf16)
    written once, the [128, 128] f32 states read and written once per (sequence, head)."""
    token_heads = total_tokens * heads
    qkv = 3 * token_heads * HEAD_DIM * _BF16
    gate = token_heads * HEAD_DIM * _F32
    beta = token_heads * _F32
    out = token_heads * HEAD_DIM * _BF16
    states = 2 * num_sequences * heads * HEAD_DIM * HEAD_DIM * _F32
    return qkv + gate + beta + out + states


def hbm_floor_us(total_tokens: int, heads: int, num_sequences: int) -> float:
    return hbm_floor_bytes(total_tokens, heads, num_sequences) / HBM_BYTES_PER_SECOND * 1e6
