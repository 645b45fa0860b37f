"""The sm90 kernels on a Hopper GPU against the float64 oracle (marker gpu; skipped elsewhere).

Fresh random data each run, the production gate (lb = -5), non-zero initial states, outputs
poisoned with NaN before the kernel writes them.
"""

import functools
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle_gradients import PREPARATIONS, preparation_id
from spec_cases import LONG_LENGTH, MANY_SEQUENCES, PACKED_LENGTHS, SINGLE_LENGTHS
from xla_env import with_xla_flags

import jax_kda
from jax_kda import sm90
from jax_kda.constants import GATE_LOWER_BOUND_MIN as LB
from jax_kda.constants import HEAD_DIM, default_scale
from jax_kda.oracle import (
    RMS_RATIO_BAR,
    long_memory_inputs,
    production_inputs,
    recurrent_oracle,
    rms_ratio,
)
from jax_kda.sm90.ffi_call import cute_call, register
from jax_kda.sm90.plan import plan_prefill

pytestmark = pytest.mark.gpu

SEED = time.time_ns() % 2**31
CASES = {
    **{f"single-{n}": ([n], 2) for n in SINGLE_LENGTHS},
    **{name: (lengths, 2 if len(lengths) <= 3 else 4) for name, lengths in PACKED_LENGTHS.items()},
    "long-16384": ([LONG_LENGTH], 2),
    "n64-h32": (list(np.random.default_rng(SEED).integers(0, 300, MANY_SEQUENCES)), 32),
    "segments-with-empties": ([4000, 1, 0], 1),  # 6 segments on 132 SMs
}


FORCED_SPLIT = 3
"""Every case also runs cut into this many segments, whatever the plan chooses, so that the
segmented path sees every length set (empty and 1-token sequences, segments past a sequence's
end) and the unsplit one does too."""


def _poisoned_kernel_call(x, segments=None):
    """The exported kernel with o, final_state and the workspace pre-filled with NaN bit
    patterns (aliased results), so that anything left unwritten shows. segments: None for the
    device's plan, else forced. Returns (o, final_state) and the segment count that ran."""
    register()
    tokens, heads, _ = x.q.shape
    seqs = x.cu_seqlens.shape[0] - 1
    results = sm90.result_shapes(tokens, heads, seqs, segments)
    plan = plan_prefill(tokens, heads, seqs, sm90.device_sm_count(), segments=segments)
    artifact = sm90.forward_artifact(heads, default_scale())

    @jax.jit
    def run(*inputs):
        # All-ones bits in the integer records read back as NaN in every field.
        poison = [
            jnp.full(r.shape, -1 if r.dtype == jnp.int32 else jnp.nan, r.dtype) for r in results
        ]
        aliases = {7 + i: i for i in range(len(results))}
        return cute_call(artifact, [*inputs, *poison], results, aliases=aliases)[:2]

    return run(*x), plan.segment_count


def _poisoned_call(artifact, results, *inputs):
    """The artifact's custom call with its results pre-filled with NaN bit patterns (aliased),
    so that anything left unwritten shows: its first two results."""
    poison = [jnp.full(r.shape, -1 if r.dtype == jnp.int32 else jnp.nan, r.dtype) for r in results]
    aliases = {len(inputs) + i: i for i in range(len(results))}
    return cute_call(artifact, [*inputs, *poison], results, aliases=aliases)[:2]


GATE_BOUND_PREP_CASES = {
    "ragged-every-preparation": ([130, 0, 70, 1], "every", 1),
    "ragged-qk-l2norm": ([64, 10, 128, 0, 65], "norm", 1),
    "gate-and-beta-bf16-projection": ([200, 3], "gate-beta", 1),
    "long-every-preparation-GVA-2": ([3000, 257], "every", 2),
    "no-tokens": ([0, 0], "every", 1),
}
"""The gate-bound forward's in-kernel preparation: (lengths, which preparations, value heads a
q head): every one, the L2 norm alone, the gate and beta logits alone (the gate's projection
given in bf16); ragged with empty and 1-token sequences, thousands of tokens, grouped value
heads, no tokens at all."""


@pytest.mark.parametrize("case", GATE_BOUND_PREP_CASES)
def test_gate_bound_forward_prepares_raw_inputs_as_the_xla_preparation(case):
    """The gate-bound forward with the inputs prepared in PREP (InputPrep: q and k
    L2-normalised, the safe gate (lower bound -5) from its raw projection with A_log and
    dt_bias, beta from logits, q and k read at head j // G for grouped value heads; or the norm
    alone; or the gate and beta alone) on raw inputs, o, the final state and the workspace
    NaN-poisoned, planned and cut into FORCED_SPLIT segments: against the plain kernel on the
    inputs jax_kda.gate prepares in XLA (q and k repeated over the groups), close (the
    preparation's roundings may differ by an ulp), and against the float64 oracle of the
    prepared inputs from a non-zero initial state; empty sequences keep their initial state
    bit for bit."""
    from oracle_gradients import raw_inputs

    from jax_kda import gate
    from jax_kda.sm90.kernels.input_prep import InputPrep

    register()
    lengths, flags, groups = GATE_BOUND_PREP_CASES[case]
    x = raw_inputs(lengths, 3, 3 * groups, seed=SEED + 17 * len(case))
    heads = 3 * groups
    q, k, v, a, beta = (jnp.asarray(t) for t in (x.q, x.k, x.v, x.a, x.beta))
    a_log, dt_bias = jnp.asarray(x.a_log), jnp.asarray(x.dt_bias)
    g = gate.kda_gate(a, a_log, dt_bias, lower_bound=LB)
    b = jax.nn.sigmoid(beta)
    q_ready, k_ready = (jnp.repeat(gate.l2_normalize(t), groups, axis=1) for t in (q, k))
    prepared = (q_ready, k_ready, v, g, b)
    params = [a_log, dt_bias.reshape(heads, HEAD_DIM)]
    if flags == "norm":
        prep, raw, params = InputPrep(qk_l2norm=True), (q, k, v, g, b), []
    elif flags == "gate-beta":  # q and k normalised ahead; the projection in bf16, as a model's
        a = a.astype(jnp.bfloat16)
        g = gate.kda_gate(a, a_log, dt_bias, lower_bound=LB)
        prepared = (q_ready, k_ready, v, g, b)
        prep = InputPrep(gate=True, lower_bound=LB, beta_logits=True)
        raw = (q_ready, k_ready, v, a.astype(jnp.float32), beta)  # as sm90.forward casts it
    else:
        prep, raw = InputPrep(True, True, LB, True, grouped_qk=groups > 1), (q, k, v, a, beta)
    _check_gate_bound_prep(case, x, prep, raw, params, prepared)


def _check_gate_bound_prep(label, x, prep, raw, params, prepared):
    """The gate-bound forward with preparation `prep` on the raw inputs (and A_log, dt_bias
    in params where it takes them), o, the final state and the workspace NaN-poisoned,
    planned and cut into FORCED_SPLIT segments: against the plain kernel on the inputs
    prepared in XLA and the float64 oracle of those; empty sequences keep their initial state
    bit for bit."""
    lengths = np.diff(x.cu_seqlens)
    heads = x.v.shape[1]
    cu = jnp.asarray(x.cu_seqlens, jnp.int32)
    state = jnp.asarray(x.initial_state)
    tokens = int(x.cu_seqlens[-1])
    with jax.enable_x64(True):
        f64 = [np.asarray(t, np.float64) for t in prepared]
        ref_o, ref_final = recurrent_oracle(
            *f64, x.cu_seqlens, np.asarray(x.initial_state, np.float64), scale=default_scale()
        )
    for forced in (None, FORCED_SPLIT):
        results = sm90.result_shapes(tokens, heads, len(lengths), forced)
        plain = functools.partial(
            _poisoned_call, sm90.forward_artifact(heads, default_scale()), results
        )
        fused = functools.partial(
            _poisoned_call, sm90.forward_artifact(heads, default_scale(), prep), results
        )
        want_o, want_final = jax.jit(plain)(*prepared, cu, state)
        got_o, got_final = jax.jit(fused)(*raw, cu, *params, state)
        got_o, got_final = np.asarray(got_o, np.float32), np.asarray(got_final)
        assert not np.isnan(got_o).any() and not np.isnan(got_final).any()
        errors = {"final vs plain": rms_ratio(got_final, want_final)}
        errors["final vs float64"] = rms_ratio(got_final, ref_final)
        if tokens:
            errors["o vs plain"] = rms_ratio(got_o, want_o)
            errors["o vs float64"] = rms_ratio(got_o, ref_o)
        print(f"{label} segments={forced}: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
        # the preparation's roundings move the products by about bf16's 2^-9 where they differ
        assert errors["final vs plain"] <= 5e-3 and errors.get("o vs plain", 0.0) <= 5e-3
        assert errors["final vs float64"] <= RMS_RATIO_BAR
        assert errors.get("o vs float64", 0.0) <= RMS_RATIO_BAR
        for s, n in enumerate(lengths):
            if n == 0:
                np.testing.assert_array_equal(got_final[s], x.initial_state[s])


@pytest.mark.parametrize("combination", PREPARATIONS, ids=preparation_id)
def test_gate_bound_forward_prepares_every_combination(combination):
    """Every combination of the gate-bound forward's in-kernel preparations (the L2 norm, the
    safe gate, beta logits, grouped value heads; oracle_gradients.preparation_case) on raw
    inputs, ragged with an empty and a 1-token sequence, from a non-zero initial state, o, the
    final state and the workspace NaN-poisoned, planned and cut into FORCED_SPLIT segments:
    against the plain kernel on the inputs prepared in XLA (close: the preparation's roundings
    may differ by an ulp) and the float64 oracle of the prepared inputs; the empty sequence
    keeps its initial state bit for bit."""
    from oracle_gradients import preparation_case, raw_inputs

    register()
    groups = 2 if combination[3] else 1
    lengths = [130, 0, 70, 1]
    seed = SEED + 29 * sum(on << i for i, on in enumerate(combination))
    x = raw_inputs(lengths, 2, 2 * groups, seed=seed)
    prep, raw, params, prepared = preparation_case(x, combination, LB)
    params = [p for p in params if p is not None]
    label = f"{preparation_id(combination)} seed={seed}"
    _check_gate_bound_prep(label, x, prep, raw, params, prepared)


def _prefill(backend):
    return jax.jit(
        lambda q, k, v, g, b, cu, s: jax_kda.prefill(
            q, k, v, g, b, cu_seqlens=cu, initial_state=s, backend=backend, gate_lower_bound=LB
        )
    )


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_float64_oracle(case):
    lengths, heads = CASES[case]
    x = production_inputs(lengths, heads, seed=SEED + len(case))
    ref_o, ref_final = recurrent_oracle(*x)
    xla_o, _ = _prefill("xla")(*x)
    for forced in (None, FORCED_SPLIT):
        (o, final), segments = _poisoned_kernel_call(x, forced)
        err_o = rms_ratio(o, ref_o) if o.size else 0.0
        err_final = rms_ratio(final, ref_final)
        err_xla = rms_ratio(o, xla_o) if o.size else 0.0
        print(
            f"{case}: {segments} segment(s){' (forced)' if forced else ''}, o {err_o:.2e}"
            f" final {err_final:.2e} vs xla {err_xla:.2e}"
        )
        if case == "segments-with-empties" and forced is None:
            assert segments > 1, "this case is there to run the planned split"
        assert not np.isnan(np.asarray(o, np.float32)).any() and not np.isnan(final).any()
        assert err_o <= RMS_RATIO_BAR and err_final <= RMS_RATIO_BAR
        assert err_xla <= RMS_RATIO_BAR
        for s, n in enumerate(lengths):
            if n == 0:
                np.testing.assert_array_equal(np.asarray(final[s]), x.initial_state[s])


@pytest.mark.parametrize("lengths", [[4000, 0, 700, 65], [16384]])
def test_long_memory_data_with_custom_scale(lengths):
    """g = -0.05 * sigmoid(.) with g = 0 on every 8th channel and a large initial state: the
    state carried between chunks and segments and the initial state matter to every output (a
    dropped one misses the oracle by far more than the bar), planned and forced segments."""
    x = long_memory_inputs(lengths, 2, seed=SEED + 11)
    ref_o, ref_final = recurrent_oracle(*x, scale=0.3)
    forgot, _ = recurrent_oracle(*x[:6], x.initial_state * 0, scale=0.3)
    assert rms_ratio(forgot, ref_o) > 10 * RMS_RATIO_BAR  # the data exposes a dropped state
    for segments in (None, FORCED_SPLIT):

        @jax.jit
        def run(q, k, v, g, beta, cu, state, segments=segments):
            if segments is None:
                return jax_kda.prefill(
                    q, k, v, g, beta, cu_seqlens=cu, initial_state=state, scale=0.3,
                    backend="sm90", gate_lower_bound=LB,
                )  # fmt: skip
            return sm90.forward(q, k, v, g, beta, cu, state, 0.3, segments=segments)

        o, final = run(*x)
        err_o, err_final = rms_ratio(o, ref_o), rms_ratio(final, ref_final)
        print(f"long memory {lengths} segments={segments}: o {err_o:.2e} final {err_final:.2e}")
        assert err_o <= RMS_RATIO_BAR and err_final <= RMS_RATIO_BAR


_UNFUSED = {"fuse_outputs": False, "outputs_warpgroup": False, "scan_plain_addend": False}
EXACT_VARIANTS = {
    "default": {},
    "unfused": _UNFUSED,
    "plain-addend": {**_UNFUSED, "scan_plain_addend": True},
    "scan-outputs-inline": {**_UNFUSED, "fuse_outputs": True, "scan_plain_addend": True},
    "outputs-images": {"outputs_images": True},
}
"""The exact forward as prefill runs it (the default: the forward scan writes the outputs
where the plan fuses them, its O products on a second warpgroup, and reads the chunk core's
bf16 U as it is) and the other settings of those sm90.training_forward switches: none of
them (the forward until 2026-12-06: the scan, then the outputs kernel, on a float32 copy of
U), the plain U alone, the outputs on the scan's own warpgroup, and (outputs_images, opt-in;
passed here on the H100, 2026-12-06, and kept off for its small gain) the chunk core writing Qg
and Aqk as the scan's operand images."""


def _exact_prefill(scale=None, variant="default"):
    """The exact 64-token forward (no gate bound): prefill on sm90 (the chunk core, then the
    forward scan with the outputs where the plan fuses them), or another setting of its
    switches through sm90.training_forward."""
    options = EXACT_VARIANTS[variant]
    if not options:
        return jax.jit(
            lambda q, k, v, g, b, cu, s: jax_kda.prefill(
                q, k, v, g, b, cu_seqlens=cu, initial_state=s, backend="sm90", scale=scale
            )
        )

    def call(q, k, v, g, b, cu, s):  # packed THD; the state [N, H, V, K], as prefill's
        return sm90.training_forward(
            q, k, v, g, b, cu, s, default_scale() if scale is None else scale, **options
        )

    return jax.jit(call)


@pytest.mark.parametrize("variant", EXACT_VARIANTS)
@pytest.mark.parametrize("case", CASES)
def test_exact_forward_matches_float64_oracle(case, variant):
    """The no-bound forward on SPEC's length sets and a non-zero initial state, as prefill runs
    it and in each other setting of its switches (the single sequences of few heads take the
    fused scan; the packed sets with more scan CTAs than SMs, such as 64 sequences of 32 heads,
    still the two kernels); empty sequences pass the state bit for bit."""
    lengths, heads = CASES[case]
    x = production_inputs(lengths, heads, seed=SEED + 3 * len(case))
    ref_o, ref_final = recurrent_oracle(*x)
    o, final = _exact_prefill(variant=variant)(*x)
    err_o = rms_ratio(o, ref_o) if o.size else 0.0
    err_final = rms_ratio(final, ref_final)
    print(f"exact forward {case} {variant}: o {err_o:.2e} final {err_final:.2e}")
    assert not np.isnan(np.asarray(o, np.float32)).any() and not np.isnan(final).any()
    assert err_o <= RMS_RATIO_BAR and err_final <= RMS_RATIO_BAR
    for s, n in enumerate(lengths):
        if n == 0:
            np.testing.assert_array_equal(np.asarray(final[s]), x.initial_state[s])


@pytest.mark.parametrize("variant", EXACT_VARIANTS)
@pytest.mark.parametrize("lengths", [[4000, 0, 700, 65], [16384]])
def test_exact_forward_long_memory_with_custom_scale(lengths, variant):
    """The no-bound forward where the carried and the initial states matter to every output
    (g = -0.05 * sigmoid(.), g = 0 on every 8th channel, a large initial state)."""
    x = long_memory_inputs(lengths, 2, seed=SEED + 13)
    ref_o, ref_final = recurrent_oracle(*x, scale=0.3)
    forgot, _ = recurrent_oracle(*x[:6], x.initial_state * 0, scale=0.3)
    assert rms_ratio(forgot, ref_o) > 10 * RMS_RATIO_BAR  # the data exposes a dropped state
    o, final = _exact_prefill(0.3, variant)(*x)
    err_o, err_final = rms_ratio(o, ref_o), rms_ratio(final, ref_final)
    print(f"exact forward, long memory {lengths} {variant}: o {err_o:.2e} final {err_final:.2e}")
    assert err_o <= RMS_RATIO_BAR and err_final <= RMS_RATIO_BAR


def test_prefill_sm90_equals_oracle_through_the_public_api():
    x = production_inputs([300, 0, 45, 16], 4, seed=SEED)
    o, final = _prefill("sm90")(*x)
    ref_o, ref_final = recurrent_oracle(*x)
    assert rms_ratio(o, ref_o) <= RMS_RATIO_BAR
    assert rms_ratio(final, ref_final) <= RMS_RATIO_BAR
    auto_o, _ = _prefill("auto")(*x)
    np.testing.assert_array_equal(np.asarray(auto_o), np.asarray(o))
    # Without a stated gate bound "auto" runs the exact 64-token forward (the state-scan kernel
    # around the XLA path's per-chunk parts).
    unbounded = jax.jit(
        lambda q, k, v, g, b, cu, s: jax_kda.prefill(q, k, v, g, b, cu_seqlens=cu, initial_state=s)
    )(*x)
    assert rms_ratio(unbounded[0], ref_o) <= RMS_RATIO_BAR
    assert rms_ratio(unbounded[1], ref_final) <= RMS_RATIO_BAR


def test_non_contiguous_inputs_under_jit():
    x = production_inputs([90, 38], 2, seed=SEED + 1)
    ref_o, ref_final = recurrent_oracle(*x)
    transposed = [jnp.asarray(np.swapaxes(a, 0, 1)) for a in x[:4]]  # stored [H, T, D]
    padded = [jnp.pad(jnp.asarray(a), ((3, 5), (0, 1), (0, 64))) for a in x[:4]]
    beta_padded = jnp.pad(jnp.asarray(x.beta), ((3, 5), (0, 1)))
    state_padded = jnp.pad(jnp.asarray(x.initial_state), ((0, 0), (0, 0), (0, 8), (0, 8)))

    sm90_call = _prefill("sm90")

    @jax.jit
    def from_transposed(q, k, v, g, beta, cu, state):
        q, k, v, g = (a.swapaxes(0, 1) for a in (q, k, v, g))
        return sm90_call(q, k, v, g, beta, cu, state)

    @jax.jit
    def from_padded(q, k, v, g, beta, cu, state):
        q, k, v, g = (a[3:-5, :2, :HEAD_DIM] for a in (q, k, v, g))
        beta, state = beta[3:-5, :2], state[:, :, :HEAD_DIM, :HEAD_DIM]
        return sm90_call(q, k, v, g, beta, cu, state)

    runs = {
        "transposed": from_transposed(*transposed, x.beta, x.cu_seqlens, x.initial_state),
        "padded-then-sliced": from_padded(*padded, beta_padded, x.cu_seqlens, state_padded),
    }
    for name, (o, final) in runs.items():
        assert rms_ratio(o, ref_o) <= RMS_RATIO_BAR, name
        assert rms_ratio(final, ref_final) <= RMS_RATIO_BAR, name


def test_batched_form_equals_packed_form():
    x = production_inputs([64] * 3, 2, seed=SEED + 2)
    o_thd, f_thd = _prefill("sm90")(*x)
    rows = [a.reshape(3, 64, *a.shape[1:]) for a in x[:5]]
    o_b, f_b = jax.jit(
        lambda *a: jax_kda.prefill(*a[:5], initial_state=a[5], backend="sm90", gate_lower_bound=LB)
    )(*rows, x.initial_state)
    np.testing.assert_array_equal(np.asarray(o_b).reshape(o_thd.shape), np.asarray(o_thd))
    np.testing.assert_array_equal(np.asarray(f_b), np.asarray(f_thd))


def test_inside_scan_and_fori_loop_chain_states_like_xla():
    x = production_inputs([70, 30], 2, seed=SEED + 3)

    def chained(backend, loop):
        step = _prefill(backend)

        @jax.jit
        def run(q, k, v, g, beta, cu, state):
            def body(s):
                return step(q, k, v, g, beta, cu, s)[1]

            if loop == "scan":
                return jax.lax.scan(lambda s, _: (body(s), None), state, None, length=4)[0]
            return jax.lax.fori_loop(0, 4, lambda i, s: body(s), state)

        return run(*x)

    for loop in ("scan", "fori_loop"):
        assert rms_ratio(chained("sm90", loop), chained("xla", loop)) <= RMS_RATIO_BAR, loop


def test_grad_through_sm90_forward():
    x = production_inputs([50, 14], 2, seed=SEED + 4)

    def loss(backend):
        def f(q, g, state):
            o, final = jax_kda.prefill(
                q,
                x.k,
                x.v,
                g,
                x.beta,
                cu_seqlens=x.cu_seqlens,
                initial_state=state,
                backend=backend,
                gate_lower_bound=LB,
            )
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final**2)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(x.q, x.g, x.initial_state)

    (value_sm90, grads_sm90), (value_xla, grads_xla) = loss("sm90"), loss("xla")
    assert abs(float(value_sm90) - float(value_xla)) <= RMS_RATIO_BAR * abs(float(value_xla))
    # The sm90 backward (state-scan kernels) against JAX's autodiff of the XLA path; the
    # cotangent 2 * o differs too, through each backend's forward.
    for a, b in zip(grads_sm90, grads_xla, strict=True):
        assert np.all(np.isfinite(np.asarray(a, np.float32)))
        assert rms_ratio(a, b) <= RMS_RATIO_BAR


def test_command_buffers_give_equal_results(tmp_path):
    """XLA command buffers (CUDA graphs) on for custom calls: results equal to the plain run."""
    script = textwrap.dedent(
        f"""
        import sys, numpy as np, jax, jax_kda
        from jax_kda.oracle import production_inputs
        x = production_inputs([200, 0, 77], 4, seed={SEED})
        f = jax.jit(lambda *a: jax_kda.prefill(*a[:5], cu_seqlens=a[5], initial_state=a[6],
                                               backend="sm90", gate_lower_bound=-5.0))
        o, final = f(*x)
        o, final = f(*x)
        np.savez(sys.argv[1], o=np.asarray(o, np.float32), final=np.asarray(final))
        """
    )
    flags = "--xla_gpu_enable_command_buffer=CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
    outputs = {}
    for name, xla_flags in (("plain", ""), ("command-buffer", flags)):
        env = with_xla_flags(xla_flags)
        path = tmp_path / f"{name}.npz"
        run = subprocess.run(
            [sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr[-3000:]
        outputs[name] = np.load(path)
    for key in ("o", "final"):
        np.testing.assert_array_equal(outputs["plain"][key], outputs["command-buffer"][key])
