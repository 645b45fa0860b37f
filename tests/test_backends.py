"""Backend choice: 'auto' serves every call; an explicit backend never falls back silently."""

import jax
import pytest

import jax_kda
from jax_kda import sm90
from jax_kda.oracle import RMS_RATIO_BAR, production_inputs, recurrent_oracle, rms_ratio


def test_auto_serves_the_call_here():
    x = production_inputs([19, 5], 2, seed=21)
    o, final = jax.jit(lambda *a: jax_kda.prefill(*a[:5], cu_seqlens=a[5], initial_state=a[6]))(*x)
    ref_o, ref_final = recurrent_oracle(*x)
    assert rms_ratio(o, ref_o) <= RMS_RATIO_BAR
    assert rms_ratio(final, ref_final) <= RMS_RATIO_BAR


@pytest.fixture
def _no_hopper(monkeypatch):
    monkeypatch.setattr(sm90.backend, "has_hopper", lambda: False)
    monkeypatch.delenv(sm90.ASSUME_SM90_ENV, raising=False)


@pytest.mark.usefixtures("_no_hopper")
def test_explicit_sm90_without_hopper_raises_with_reason():
    x = production_inputs([16], 1, seed=0)
    with pytest.raises(
        jax_kda.BackendUnavailableError, match=r"backend=.sm90. cannot serve.*not a Hopper"
    ):
        jax_kda.prefill(*x[:5], backend="sm90", gate_lower_bound=-5.0)
