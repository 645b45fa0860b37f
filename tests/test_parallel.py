"""Context parallelism (jax_kda.parallel): packed tokens split over 2 and 4 host devices, against
the float64 oracle, forward and gradients, on the XLA backend.

The device count is fixed at JAX's start, so each test runs its check (a function of this
module) in a fresh process with four host devices. The data remembers (long_memory_inputs, a
non-zero initial state): a state dropped at a device boundary misses the oracle by far, which
each forward check asserts of the oracle itself, so that passing means the exchange works."""

import itertools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from oracle_gradients import float64_gradients, loss_weights
from xla_env import host_devices

from jax_kda import parallel
from jax_kda.oracle import (
    RMS_RATIO_BAR,
    long_memory_inputs,
    production_inputs,
    recurrent_oracle,
    rms_ratio,
)

HOST_DEVICES = 4
FLOAT32_BAR = 1e-5  # float32 inputs: the XLA path tracks the float64 oracle to about 1e-6
HEADS = 2
TOKENS = 512  # 128 or 256 a device
NAMES = ("q", "k", "v", "g", "beta", "initial_state")

CASES = {
    "one-sequence": [TOKENS],
    # 250 tokens from 100: to the end of device 0, all of device 1 (of 4), into device 2
    "straddling": [100, 0, 250, 30, 132],
    # on 4 devices: a sequence ending on a boundary, an empty one there, a two-token one from
    # device 1's last token into device 2 (on 2 devices: from device 0's last token)
    "boundary-edges": [128, 0, 127, 2, 255],
    "all-empty": [0, 0],
}


def _in_fresh_process(check: str, *args) -> None:
    """Run check(*args), a function of this module, in a process with HOST_DEVICES devices."""
    tests = Path(__file__).resolve().parent
    env = host_devices(
        HOST_DEVICES,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests)]),
    )
    code = f"import test_parallel; test_parallel.{check}(*{args!r}); print('ok')"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    print(run.stdout)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def _mesh(devices, shape=None, names=("tokens",)):
    return Mesh(np.array(jax.devices()[:devices]).reshape(shape or (devices,)), names)


def _on_mesh(mesh, **options):
    """A jitted prefill_on_mesh(q, k, v, g, beta, cu_seqlens, initial_state) on the XLA backend."""

    def call(q, k, v, g, beta, cu_seqlens, initial_state):
        return parallel.prefill_on_mesh(
            q, k, v, g, beta, cu_seqlens=cu_seqlens, initial_state=initial_state, mesh=mesh,
            token_axis="tokens", backend="xla", **options,
        )  # fmt: skip

    return jax.jit(call)


def _without_exchange(x, devices):
    """The oracle with every sequence cut at the device boundaries and its later pieces started
    from zero: what context parallelism gives if the carried state is dropped."""
    shard = x.q.shape[0] // devices
    cu = [int(c) for c in x.cu_seqlens]
    cuts = sorted(set(cu) | set(range(0, cu[-1] + 1, shard)))
    state = np.zeros((len(cuts) - 1, *x.initial_state.shape[1:]), np.float32)
    for s, start in enumerate(cu[:-1]):
        state[cuts.index(start)] = x.initial_state[s]  # (the last of equal cuts, empty or not)
    return recurrent_oracle(*x[:5], np.asarray(cuts), state)[0]


def check_forward(devices):
    """Every case on `devices` devices: float32 long-memory data within FLOAT32_BAR, bf16
    long-memory and production data within SPEC's bar; empty sequences pass their state
    through; without the exchange the same data misses by far on the sequences that straddle
    devices."""
    mesh = _mesh(devices)
    run = _on_mesh(mesh)
    shard = TOKENS // devices
    for case, lengths in CASES.items():
        for dtype, make, bar in (
            (jnp.float32, long_memory_inputs, FLOAT32_BAR),
            (jnp.bfloat16, long_memory_inputs, RMS_RATIO_BAR),
            (jnp.bfloat16, production_inputs, RMS_RATIO_BAR),
        ):
            seed = devices + len(lengths)
            x = make(lengths, HEADS, seed=seed, dtype=dtype)
            o, final = run(*x)
            ref_o, ref_final = recurrent_oracle(*x)
            errors = (rms_ratio(o, ref_o) if o.size else 0.0, rms_ratio(final, ref_final))
            label = f"{case} {devices} devices {make.__name__} {dtype.__name__} seed {seed}"
            print(f"{label}: o {errors[0]:.2e} final {errors[1]:.2e}")
            assert o.dtype == dtype and o.shape == x.q.shape, label
            assert max(errors) <= bar, label
            for s, n in enumerate(lengths):
                if n == 0:
                    np.testing.assert_array_equal(np.asarray(final[s]), x.initial_state[s])
            straddling = np.zeros(x.q.shape[0], bool)  # tokens of sequences across devices
            for a, c in itertools.pairwise(x.cu_seqlens):
                straddling[a:c] = any(a < b * shard < c for b in range(1, devices))
            if make is long_memory_inputs and dtype == jnp.float32 and straddling.any():
                dropped = _without_exchange(x, devices)[straddling]
                miss = rms_ratio(dropped, ref_o[straddling])
                print(f"{label}: without the exchange, o of those sequences {miss:.2e}")
                assert miss > 10 * RMS_RATIO_BAR, label

    x = long_memory_inputs([100, 412], HEADS, seed=1, dtype=jnp.float32)
    o, final = _on_mesh(mesh, output_final_state=False)(*x)
    assert final is None
    assert rms_ratio(o, recurrent_oracle(*x)[0]) <= FLOAT32_BAR

    x = production_inputs([TOKENS + 1], HEADS, seed=1, dtype=jnp.float32)
    try:
        run(*x)
    except ValueError as error:
        assert f"got T = {TOKENS + 1} tokens, expected a multiple of the {devices}" in str(error)
    else:
        raise AssertionError("T not a multiple of the devices was accepted")


@pytest.mark.parametrize("devices", [2, 4])
def test_forward_matches_the_oracle(devices):
    _in_fresh_process("check_forward", devices)


def _check_gradients(x, run, label):
    """Gradients of sum(o * w_o) + sum(final * w_f) within FLOAT32_BAR of float64 autodiff."""
    w_o, w_f = loss_weights(x, seed=2)

    def loss(q, k, v, g, beta, state):
        o, final = run(q, k, v, g, beta, x.cu_seqlens, state)
        return jnp.sum(o * w_o) + jnp.sum(final * w_f)

    ours = jax.jit(jax.grad(loss, argnums=range(6)))(*x[:5], x.initial_state)
    ref = float64_gradients(x, w_o, w_f)
    for name, d, r in zip(NAMES, ours, ref, strict=True):
        error = rms_ratio(d, r)
        print(f"{label} grad {name}: rms_ratio {error:.2e}")
        assert d.shape == r.shape and error <= FLOAT32_BAR, (label, name)


def check_gradients(devices, case):
    x = long_memory_inputs(CASES[case], HEADS, seed=devices, dtype=jnp.float32)
    _check_gradients(x, _on_mesh(_mesh(devices)), f"{case} {devices} devices")


@pytest.mark.parametrize(("devices", "case"), [(2, "one-sequence"), (4, "straddling")])
def test_gradients_match_the_float64_oracle(devices, case):
    _in_fresh_process("check_gradients", devices, case)


def check_tokens_and_heads():
    """Tokens over one axis of a 2 x 2 mesh, heads over the other: forward and gradients."""
    mesh = _mesh(4, (2, 2), ("tokens", "heads"))
    run = _on_mesh(mesh, head_axis="heads")
    x = long_memory_inputs(CASES["straddling"], HEADS, seed=3, dtype=jnp.float32)
    o, final = run(*x)
    ref_o, ref_final = recurrent_oracle(*x)
    assert rms_ratio(o, ref_o) <= FLOAT32_BAR and rms_ratio(final, ref_final) <= FLOAT32_BAR
    assert o.sharding.spec == P("tokens", "heads"), o.sharding.spec
    assert final.sharding.spec == P(None, "heads"), final.sharding.spec
    _check_gradients(x, run, "2 x 2 mesh")


def test_tokens_and_heads_on_a_two_by_two_mesh():
    _in_fresh_process("check_tokens_and_heads")


def test_batched_form_is_refused_with_a_reason():
    x = production_inputs([64, 64], 1, seed=0, dtype=jnp.float32)
    rows = [a.reshape(2, 64, *a.shape[1:]) for a in x[:5]]
    with pytest.raises(ValueError, match=r"q: got shape \(2, 64, 1, 128\), expected this device"):
        parallel.prefill_on_mesh(*rows, mesh=_mesh(1), token_axis="tokens", backend="xla")


def test_grouped_value_heads_are_refused_with_a_reason():
    x = production_inputs([64], 2, seed=0, dtype=jnp.float32)
    q, k = (a[:, :1] for a in x[:2])
    with pytest.raises(ValueError, match="grouped value heads are not served here yet"):
        parallel.prefill_on_mesh(q, k, *x[2:5], mesh=_mesh(1), token_axis="tokens", backend="xla")
