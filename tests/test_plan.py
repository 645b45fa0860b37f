"""The static plan: pure Python, checked on any machine."""

import pytest

from jax_kda.plan import WorkspaceBuffer, plan_prefill


@pytest.mark.parametrize(("tokens", "heads", "seqs"), [(0, 2, 3), (33, 2, 3), (16384, 16, 8)])
def test_fused_kernel_plan_has_one_launch_and_no_workspace(tokens, heads, seqs):
    plan = plan_prefill(tokens, heads, seqs)
    assert (plan.segment_count, plan.launches, plan.workspace, plan.workspace_bytes) == (
        1,
        1,
        (),
        0,
    )


def test_many_short_sequences_need_no_per_segment_workspace():
    plan = plan_prefill(64 * 128, 32, 64)
    assert plan.workspace_bytes == 0


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
