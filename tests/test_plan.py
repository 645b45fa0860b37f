"""The static plan: pure Python, checked on any machine."""

import pytest

from jax_kda.plan import CHUNK_RECORD_BYTES, WorkspaceBuffer, plan_prefill


@pytest.mark.parametrize(
    ("tokens", "heads", "seqs", "slots"), [(0, 2, 3, 3), (33, 2, 3, 5), (16384, 16, 8, 1032)]
)
def test_plan_is_prep_then_expand_with_one_record_per_chunk_slot(tokens, heads, seqs, slots):
    plan = plan_prefill(tokens, heads, seqs)
    assert (plan.segment_count, plan.launches) == (1, 2)
    (records,) = plan.workspace
    assert records.shape == (slots, heads, CHUNK_RECORD_BYTES // 16, 4)
    assert plan.workspace_bytes == slots * heads * CHUNK_RECORD_BYTES


def test_workspace_buffer_bytes():
    assert WorkspaceBuffer("x", (3, 4, 128), "bfloat16").bytes == 3 * 4 * 128 * 2
    assert WorkspaceBuffer("y", (5, 16), "float32").bytes == 5 * 16 * 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1, 2, 1), "total_tokens: got -1"),
        ((16, 0, 1), "num_heads: got 0"),
        ((16, 2, 0), "num_sequences: got 0"),
        ((16.0, 2, 1), "total_tokens: got 16.0"),
    ],
)
def test_plan_rejects_bad_shapes(args, message):
    with pytest.raises(ValueError, match=message):
        plan_prefill(*args)
