"""benchmarks.decode on the CPU: its byte model and a quick run (the GPU timing itself is for the
H200)."""

import pytest

from benchmarks import decode
from benchmarks.hbm import HBM_BYTES_PER_SECOND, decode_bytes, decode_floor_us
from jax_kda.oracle import RMS_RATIO_BAR


def test_decode_bytes_count_each_tensor_once():
    # N=2, H=1: q, k, v 3*2*128*2, g 2*128*4, beta 2*4, o 2*128*2, states 2*2*128*128*4
    dense = 1536 + 1024 + 8 + 512 + 262144
    assert decode_bytes(2, 1, pooled=False) == dense
    assert decode_bytes(2, 1, pooled=True) == dense + 2 * 4  # the int32 indices
    # float32 q, k, v and o: twice their bytes
    assert decode_bytes(2, 1, qkv_bytes=4, pooled=False) == dense + 1536 + 512


def test_decode_floor_is_dominated_by_the_states():
    # 256 sequences x 32 heads: 2 * 8192 states of 64 KiB at 4.8 TB/s (224 us) and the tokens
    floor = decode_floor_us(256, 32, pooled=True)
    states_us = 2 * 256 * 32 * 128 * 128 * 4 / HBM_BYTES_PER_SECOND * 1e6
    assert states_us < floor < 1.05 * states_us
    assert floor == pytest.approx(226.3, abs=0.1)


def test_quick_run_measures_both_layouts_and_checks_accuracy(capsys):
    rows = decode.main(["--quick", "--only", "3x2"])
    assert [(r["shape"], r["layout"]) for r in rows] == [("3x2", "dense"), ("3x2", "pool")]
    for row in rows:
        assert row["gpu_us"] > 0
        assert row["floor_ratio"] == pytest.approx(row["gpu_us"] / row["floor_us"])
        assert row["o_rms_ratio"] <= RMS_RATIO_BAR
        assert row["state_rms_ratio"] <= 1e-5
    assert "| 3x2 | pool |" in capsys.readouterr().out
