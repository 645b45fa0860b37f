"""CPU CI for the sm90 path: every kernel variant compiles and exports for sm_90a, and the jitted
prefill lowers for CUDA to our custom call, without a GPU (CUTE_DSL_ARCH=sm_90a)."""

import ast
import functools
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from xla_env import host_devices

import jax_kda
from jax_kda import api, sm90, xla
from jax_kda.oracle import production_inputs
from jax_kda.sm90 import export as cute_export
from jax_kda.sm90.ffi_call import TARGET
from jax_kda.sm90.kernels.layout import SCAN_TC_V_SLICES, SCAN_VARIANTS
from jax_kda.sm90.plan import plan_prefill

# Heads from SPEC's shapes and the small/many-sequence cases; every one is a separate variant.
VARIANT_HEADS = [1, 2, 4, 32]


SM_COUNT = 132  # an H200's, for the plan; CI has no GPU to read it from


@pytest.fixture(autouse=True)
def _lower_for_hopper(monkeypatch):
    monkeypatch.setenv(sm90.ASSUME_SM90_ENV, "1")
    monkeypatch.setenv(sm90.SM_COUNT_ENV, str(SM_COUNT))
    # the tests below pin the recompute structure (the gate-bound forward kernels, then the
    # backward's own recompute) unless a call names its residuals;
    # test_grad_with_saved_residuals_lowers_without_a_recompute checks the saved one (the default)
    monkeypatch.setattr(jax_kda, "prefill", _recompute_unless_named(api.prefill))


def _recompute_unless_named(prefill):
    def call(*args, **options):
        options.setdefault("residuals", "recompute")
        return prefill(*args, **options)

    return call


def _lower(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _prefill(**options):
    options.setdefault("gate_lower_bound", -5.0)

    def fn(q, k, v, g, beta, cu, state):
        return jax_kda.prefill(q, k, v, g, beta, cu_seqlens=cu, initial_state=state, **options)

    return fn


def _custom_calls(text):
    return re.findall(r"stablehlo\.custom_call @(\w+)\(.*\) \{.*\} : \(.*\) -> (.*)$", text, re.M)


@pytest.mark.parametrize("heads", VARIANT_HEADS)
def test_kernel_variant_exports_for_sm90a(heads):
    artifact = sm90.forward_artifact(heads, 128**-0.5)
    assert artifact.object_bytes[:4] == b"\x7fELF"
    assert f"kda_fwd_sm90_h{heads}_" in artifact.prefix
    assert len(artifact.tensors) == 12  # 7 inputs, o, final_state, 3 workspace buffers


def test_custom_scale_is_its_own_variant():
    a = sm90.forward_artifact(2, 0.125)
    b = sm90.forward_artifact(2, 128**-0.5)
    assert a.prefix != b.prefix and a.key != b.key


@pytest.mark.parametrize(
    ("lengths", "heads", "segments"), [([17, 0, 16], 2, 1), ([2048], 12, 5), ([4000, 1, 0], 1, 6)]
)
def test_prefill_lowers_to_one_custom_call_with_the_planned_results(lengths, heads, segments):
    x = production_inputs(lengths, heads, seed=0)
    calls = _custom_calls(_lower(_prefill(backend="sm90"), *x))
    assert [name for name, _ in calls] == [TARGET]
    tokens, seqs = sum(lengths), len(lengths)
    plan = plan_prefill(tokens, heads, seqs, SM_COUNT)
    assert plan.segment_count == segments
    dtypes = {"int32": "i32", "float32": "f32"}
    expected = [f"tensor<{tokens}x{heads}x128xbf16>", f"tensor<{seqs}x{heads}x128x128xf32>"]
    expected += [f"tensor<{'x'.join(map(str, b.shape))}x{dtypes[b.dtype]}>" for b in plan.workspace]
    assert calls[0][1] == f"({', '.join(expected)})"


def test_new_tokens_or_sequences_do_not_compile_again():
    _lower(_prefill(backend="sm90"), *production_inputs([40, 9], 2, seed=1))
    before = cute_export.COMPILE_COUNT
    for lengths in ([5], [100, 0, 3, 60], [0, 0], [3000]):  # the last one is split
        x = production_inputs(lengths, 2, seed=2)
        assert TARGET in _lower(_prefill(backend="sm90"), *x)
    assert cute_export.COMPILE_COUNT == before


def test_auto_picks_sm90_for_bf16_and_xla_for_float32():
    x = production_inputs([20], 2, seed=3)
    assert TARGET in _lower(_prefill(), *x)
    # Without a gate bound: the exact forward (the chunk-core kernel's forward-alone variant,
    # then the state scan that writes the outputs: 16 scan CTAs here), no forward kernel.
    for backend in ("auto", "sm90"):
        prefixes = re.findall(
            r'prefix = "(\w+)"', _lower(_prefill(backend=backend, gate_lower_bound=None), *x)
        )
        kinds = {p.rsplit("_", 1)[0] for p in prefixes}
        expected = {"kda_chunk_operands_sm90_x1_fwd", "kda_state_scan_sm90_fwd"}
        assert kinds == expected and prefixes[-1].endswith("x1ofw"), prefixes
    x32 = production_inputs([20], 2, seed=3, dtype=jnp.float32)
    assert TARGET not in _lower(_prefill(), *x32)
    with pytest.raises(jax_kda.BackendUnavailableError, match="take bfloat16 q, k, v; got float32"):
        _lower(_prefill(backend="sm90"), *x32)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["safe-gate", "softplus-gate"])
def test_prepared_inputs_and_grouped_heads_lower_to_the_kernels(lower_bound):
    """fla's input flags and grouped value heads (q, k with 1 head, v with 2) on sm90: with the
    safe gate's lower_bound the fast forward kernel serves the call (the bound is stated by
    the gate), without it the exact forward; the gradient lowers to the backward kernels."""
    from oracle_gradients import raw_inputs

    x = raw_inputs([70, 0, 30], 1, 2, seed=4)

    def loss(q, k, v, a, b, state, a_log, dt_bias):
        o, final = jax_kda.prefill(
            q, k, v, a, b, cu_seqlens=x.cu_seqlens, initial_state=state, backend="sm90",
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=a_log,
            dt_bias=dt_bias, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=True,
        )  # fmt: skip
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final**2)

    args = (*x[:5], x.initial_state, x.a_log, x.dt_bias)
    text = _lower(jax.grad(loss, argnums=range(8)), *args)
    kinds = {p.rsplit("_", 1)[0] for p in re.findall(r'prefix = "(\w+)"', text)}
    # the forward autodiff runs (residuals="recompute" here): the gate-bound kernel, or the
    # exact forward with the chunk core's forward-alone variant
    forward = {"kda_fwd_sm90_h2"} if lower_bound is not None else {"kda_chunk_operands_sm90_x1_fwd"}
    # the backward's chunk core stores no gamma (_ng): the fused backward sums g itself
    assert kinds == forward | {
        "kda_chunk_operands_sm90_x1_ng", "kda_decayed_tokens_bwd_sm90", "kda_state_scan_sm90_fwd",
        "kda_state_scans_sm90", "kda_dense_bwd_sm90", "kda_state_cotangent_sm90",
    }, kinds  # fmt: skip


def test_calls_beyond_32_bit_indexing_go_to_xla_or_are_refused():
    tokens, heads = 1 << 19, 64  # 2^32 elements in q; only shapes, no data
    shapes = [
        jax.ShapeDtypeStruct((tokens, heads, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((tokens, heads, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((tokens, heads, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((tokens, heads, 128), jnp.float32),
        jax.ShapeDtypeStruct((tokens, heads), jnp.float32),
        jax.ShapeDtypeStruct((2,), jnp.int32),
        jax.ShapeDtypeStruct((1, heads, 128, 128), jnp.float32),
    ]
    with pytest.raises(jax_kda.BackendUnavailableError, match=r"beyond the kernels' 32-bit"):
        jax.jit(_prefill(backend="sm90")).trace(*shapes)
    assert TARGET not in str(jax.jit(_prefill()).trace(*shapes).jaxpr)


def test_calls_beyond_cuda_grid_limits_go_to_xla_or_are_refused():
    sequences, heads = 70_000, 1  # one launch grid's z extent would pass 65535
    token = jax.ShapeDtypeStruct((sequences, heads, 128), jnp.bfloat16)
    shapes = [
        token,
        token,
        token,
        jax.ShapeDtypeStruct((sequences, heads, 128), jnp.float32),
        jax.ShapeDtypeStruct((sequences, heads), jnp.float32),
        jax.ShapeDtypeStruct((sequences + 1,), jnp.int32),
        jax.ShapeDtypeStruct((sequences, heads, 128, 128), jnp.float32),
    ]
    with pytest.raises(jax_kda.BackendUnavailableError, match=r"beyond CUDA's 65535"):
        jax.jit(_prefill(backend="sm90")).trace(*shapes)
    assert TARGET not in str(jax.jit(_prefill()).trace(*shapes).jaxpr)


def test_lowers_inside_scan_fori_loop_grad_and_batched():
    x = production_inputs([24, 8], 2, seed=4)
    step = _prefill(backend="sm90")

    def in_scan(q, k, v, g, beta, cu, state):
        def body(s, _):
            return step(q, k, v, g, beta, cu, s)[1], None

        return jax.lax.scan(body, state, None, length=3)[0]

    def in_fori(q, k, v, g, beta, cu, state):
        return jax.lax.fori_loop(0, 3, lambda i, s: step(q, k, v, g, beta, cu, s)[1], state)

    def loss(q, k, v, g, beta, cu, state):
        o, final = step(q, k, v, g, beta, cu, state)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    def value_and_grad(*a):
        return jax.value_and_grad(loss, argnums=(0, 3, 6))(*a)

    for fn in (in_scan, in_fori, value_and_grad):
        assert TARGET in _lower(fn, *x), fn.__name__

    rows = [a.reshape(2, 16, *a.shape[1:]) for a in x[:5]]

    def batched(q, k, v, g, beta, state):
        return jax_kda.prefill(
            q, k, v, g, beta, initial_state=state, backend="sm90", gate_lower_bound=-5.0
        )

    state = x.initial_state
    assert TARGET in _lower(batched, *rows, state)


@pytest.mark.parametrize("variant", SCAN_VARIANTS)
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_state_scan_variants_export_for_sm90a(reverse, variant):
    artifact = sm90.state_scan_artifact(reverse, *SCAN_VARIANTS[variant])
    assert artifact.object_bytes[:4] == b"\x7fELF"
    assert len(artifact.tensors) == 8  # A, B, decay, addend, cu_seqlens, y0, states, final


@pytest.mark.parametrize(
    "passes, residuals, kind",
    [(3, True, "kda_chunk_operands_sm90_"), (1, True, "kda_chunk_operands_sm90_x1_"),
     (1, False, "kda_chunk_operands_sm90_x1_fwd_")],
    ids=["bf16x3", "bf16x1", "bf16x1-forward-alone"],
)  # fmt: skip
def test_chunk_core_exports_for_sm90a(passes, residuals, kind):
    """The tensor-core chunk core compiles and exports for sm_90a (symbolic slots and heads):
    three passes, one, and one for a forward alone (gamma, kk and tinv left unwritten)."""
    artifact = sm90.chunk_operands_artifact(0.3, passes, residuals)
    assert artifact.object_bytes[:4] == b"\x7fELF"
    assert artifact.prefix.startswith(kind) and artifact.prefix.count("_") == kind.count("_")
    assert len(artifact.tensors) == 15  # q, k, v, g, beta, cu_seqlens, 7 outputs, W and Kd images


@pytest.mark.parametrize("bf16_cotangents", [True, False], ids=["bf16", "f32"])
def test_tokens_bwd_exports_for_sm90a(bf16_cotangents):
    """The backward into the tokens' rows compiles and exports for sm_90a (symbolic tokens,
    heads, slots and sequences), for the dense kernel's bf16 cotangents and XLA's float32."""
    artifact = sm90.tokens_bwd_artifact(0.3, bf16_cotangents)
    assert artifact.object_bytes[:4] == b"\x7fELF"
    assert len(artifact.tensors) == 20  # 15 inputs and 5 results
    assert artifact.tensors[-1].rank == 3  # dbeta's partial sums [2, T, H], one a half
    assert artifact.prefix.startswith("kda_tokens_bwd_sm90_" + ("" if bf16_cotangents else "f32_"))


def test_decayed_tokens_bwd_exports_for_sm90a():
    """The decayed backward with the tokens' backward fused after it compiles and exports for
    sm_90a (symbolic tokens, heads, slots and sequences), its own variant per scale."""
    artifact = sm90.decayed_tokens_bwd_artifact(0.3)
    assert artifact.object_bytes[:4] == b"\x7fELF"
    assert artifact.prefix.startswith("kda_decayed_tokens_bwd_sm90_")
    # 13 inputs (no gamma: the kernel sums g itself) and 5 results
    assert len(artifact.tensors) == 18
    assert artifact.tensors[-1].rank == 3  # dbeta's partial sums [2, T, H], one a half
    assert sm90.decayed_tokens_bwd_artifact(128**-0.5).key != artifact.key


def test_decayed_tokens_bwd_stamps_variant_exports_and_lowers():
    """The fused backward's stamps variant (a diagnostic: every CTA's phase clocks for
    benchmarks/decayed_bwd_phases.py) writes one more result, int32 [slots, H, 2,
    len(DECAYED_STAMPS)], and has a key of its own; decayed_tokens_bwd_stamps lowers to it
    alone."""
    from jax_kda.sm90.kernels.kda_decayed_bwd_sm90 import DECAYED_PHASES, DECAYED_STAMPS

    assert len(DECAYED_STAMPS) == len(DECAYED_PHASES) + 3
    artifact = sm90.decayed_tokens_bwd_artifact(0.3, True)
    assert artifact.prefix.startswith("kda_decayed_tokens_bwd_sm90_stamps_")
    assert len(artifact.tensors) == 19 and artifact.tensors[-1].rank == 4
    assert artifact.key != sm90.decayed_tokens_bwd_artifact(0.3).key
    tokens = tuple(jnp.zeros((70, 2, 128), t) for t in [jnp.bfloat16] * 3 + [jnp.float32])
    tokens += (jnp.zeros((70, 2), jnp.float32),)
    chunk = jnp.zeros((3, 2, 64, 128), jnp.bfloat16)
    pairs = jnp.zeros((3, 2, 64, 64), jnp.bfloat16)
    cotangents = (jnp.zeros((3, 2, 64, 256), jnp.bfloat16), jnp.zeros((3, 2, 64)), chunk, chunk,
                  jnp.zeros((3, 2, 128)))  # fmt: skip
    cu = jnp.asarray([0, 70], jnp.int32)

    def stamps(tokens, cu, d_kk, d_attn, cotangents):
        return sm90.backend.decayed_tokens_bwd_stamps(0.3, tokens, cu, d_kk, d_attn, cotangents)

    hlo = _lower(stamps, tokens, cu, pairs, pairs, cotangents)
    assert re.findall(r'prefix = "(\w+)"', hlo) == [artifact.prefix]


def test_decayed_tokens_bwd_refuses_float32_cotangents():
    """The fused kernel takes the dense kernel's bf16 cotangents only: float32 ones (XLA's dense
    backward) are refused, never rounded on the way in."""
    tokens = tuple(jnp.zeros((70, 2, 128), t) for t in [jnp.bfloat16] * 3 + [jnp.float32])
    tokens += (jnp.zeros((70, 2), jnp.float32),)
    chunk = jnp.zeros((3, 2, 64, 128), jnp.float32)
    pairs = jnp.zeros((3, 2, 64, 64), jnp.float32)
    cotangents = (jnp.zeros((3, 2, 64, 256)), chunk[..., 0, :64], chunk, chunk, chunk[:, :, 0])
    with pytest.raises(TypeError, match="bfloat16"):
        sm90.decayed_tokens_bwd_kernel(
            0.3, tokens, jnp.asarray([0, 70], jnp.int32), None, pairs, pairs, cotangents
        )


@pytest.mark.parametrize("bf16_cotangents", [True, False], ids=["bf16", "f32"])
def test_decayed_bwd_tokens_variant_exports_for_both_cotangent_dtypes(bf16_cotangents):
    artifact = sm90.decayed_bwd_artifact(True, 0.3, bf16_cotangents)
    assert artifact.object_bytes[:4] == b"\x7fELF"
    assert artifact.prefix.startswith(
        "kda_decayed_bwd_tokens_sm90_" + ("" if bf16_cotangents else "f32_")
    )
    with pytest.raises(ValueError, match="tokens' variant"):
        sm90.decayed_bwd_artifact(False, 1.0, True)


def test_chunk_outputs_exports_for_sm90a():
    """The forward's outputs after the scan compile and export for sm_90a."""
    artifact = sm90.chunk_outputs_artifact()
    assert artifact.object_bytes[:4] == b"\x7fELF"
    assert len(artifact.tensors) == 7  # states, w_img, u, qg, attn, cu_seqlens and o


@pytest.mark.parametrize("v_slice", SCAN_TC_V_SLICES)
def test_state_scan_with_outputs_exports_for_sm90a(v_slice):
    """The forward tensor-core scan that writes the outputs compiles and exports for sm_90a, a
    variant of its own; the reverse direction and three passes are refused."""
    from jax_kda.sm90.kernels.kda_state_scan_sm90 import ScanConfig
    from jax_kda.sm90.kernels.kda_state_scan_tc_sm90 import ChunkStateScanTcSm90

    artifact = sm90.state_scan_outputs_artifact(v_slice)
    assert artifact.object_bytes[:4] == b"\x7fELF"
    assert artifact.prefix == f"kda_state_scan_sm90_fwd_t{v_slice}x1o"
    assert artifact.key != sm90.state_scan_artifact(False, v_slice, True, 1).key
    # a_img, bt_img, decay, addend, cu_seqlens, y0, qg, attn; states, final, o
    assert len(artifact.tensors) == 11
    alone = sm90.state_scan_outputs_artifact(v_slice, False)  # no chunk states: final, o
    assert alone.prefix == f"kda_state_scan_sm90_fwd_t{v_slice}x1of" and len(alone.tensors) == 10
    for states, suffix in ((True, "ow"), (False, "ofw")):  # O on a second warpgroup
        split = sm90.state_scan_outputs_artifact(v_slice, states, True)
        assert split.prefix == f"kda_state_scan_sm90_fwd_t{v_slice}x1{suffix}"
        assert len(split.tensors) == len(sm90.state_scan_outputs_artifact(v_slice, states).tensors)
    with pytest.raises(ValueError, match="a warpgroup of its own for the outputs needs outputs"):
        ChunkStateScanTcSm90(ScanConfig(reverse=False, v_slice=v_slice), 1, outputs_warpgroup=True)
    for reverse, passes in ((True, 1), (False, 3)):
        with pytest.raises(ValueError, match="outputs forward at one bf16 pass only"):
            ChunkStateScanTcSm90(ScanConfig(reverse=reverse, v_slice=v_slice), passes, True)
    with pytest.raises(ValueError, match="runs on tensor cores"):
        sm90.state_scan_outputs_artifact(64)
    images = sm90.state_scan_outputs_artifact(v_slice, False, True, True)  # Qg, Aqk as images
    assert images.prefix == f"kda_state_scan_sm90_fwd_t{v_slice}x1ofwi"
    assert images.object_bytes[:4] == b"\x7fELF"
    assert len(images.tensors) == len(sm90.state_scan_outputs_artifact(v_slice, False).tensors)
    for states, split in ((True, True), (False, False)):
        with pytest.raises(ValueError, match="variant of the scan with outputs_warpgroup=True"):
            sm90.state_scan_outputs_artifact(v_slice, states, split, True)


def test_chunk_core_input_prep_variants_export_and_lower_with_their_operands():
    """The chunk core with the inputs prepared in the kernel (InputPrep):
    a variant of its own for each preparation (the bounded and the softplus gate apart), the
    gate's variant taking A_log [H] and dt_bias [H, 128] after cu_seqlens; nothing prepared is
    the plain kernel; chunk_core_kernel lowers to one custom call on the raw inputs (dt_bias in
    fla's flat layout too), and refuses A_log or dt_bias without an in-kernel gate."""
    from jax_kda.sm90.kernels.input_prep import InputPrep

    plain = sm90.chunk_operands_artifact(0.3, 1, False)
    assert sm90.chunk_operands_artifact(0.3, 1, False, False, InputPrep()).key == plain.key
    every = InputPrep(qk_l2norm=True, gate=True, lower_bound=-5.0, beta_logits=True)
    softplus = InputPrep(qk_l2norm=True, gate=True, beta_logits=True)
    norm = InputPrep(qk_l2norm=True)
    grouped = InputPrep(grouped_qk=True)
    keys = {plain.key}
    for prep, tag, inputs in ((every, "prepnlb", 8), (softplus, "prepnsb", 8), (norm, "prepn", 6),
                              (grouped, "prepgv", 6)):  # fmt: skip
        artifact = sm90.chunk_operands_artifact(0.3, 1, False, False, prep)
        assert artifact.prefix.startswith(f"kda_chunk_operands_sm90_x1_fwd_{tag}_"), prep
        assert len(artifact.tensors) == inputs + 9, prep  # the inputs, then nine results
        keys.add(artifact.key)
        if prep.gate:
            assert [t.rank for t in artifact.tensors[6:8]] == [1, 2]  # A_log, dt_bias
    assert len(keys) == 5
    with pytest.raises(ValueError, match="lower_bound is the in-kernel gate's"):
        InputPrep(lower_bound=-5.0)
    with pytest.raises(ValueError, match=r"lower_bound -6.0 is outside \[-5.0, 0\)"):
        InputPrep(gate=True, lower_bound=-6.0)

    x = production_inputs([100, 0, 30], 2, seed=4)
    slots = xla.chunk_slot_count(x.q.shape[0], 3)
    a_log, dt_bias = jnp.zeros((2,)), jnp.zeros((2 * 128,))

    def core(q, k, v, g, beta, cu, *params, prep=every):
        return sm90.chunk_core_kernel(q, k, v, g, beta, cu, slots, 0.3, 1, False, False, prep,
                                      *params)  # fmt: skip

    hlo = _lower(core, *x[:6], a_log, dt_bias)
    assert re.findall(r'prefix = "(\w+)"', hlo) == [_prefix(every)], hlo[:2000]
    assert "stablehlo.rsqrt" not in hlo and "stablehlo.logistic" not in hlo  # none in XLA
    with pytest.raises(ValueError, match="a_log and dt_bias go with an in-kernel gate"):
        _lower(functools.partial(core, prep=norm), *x[:6], a_log, dt_bias)
    with pytest.raises(ValueError, match=r"dt_bias: got shape \(128,\), expected \(2, 128\)"):
        _lower(core, *x[:6], a_log, dt_bias[:128])
    with pytest.raises(ValueError, match=r"a_log: got shape \(3,\), expected \(2,\)"):
        _lower(core, *x[:6], jnp.zeros(3), dt_bias)
    # grouped value heads: q and k with 1 head against v's 2, only in the grouped variant
    one_head = [t[:, :1] for t in x[:2]]
    hlo = _lower(functools.partial(core, prep=grouped), *one_head, *x[2:6])
    assert re.findall(r'prefix = "(\w+)"', hlo) == [_prefix(grouped)]
    with pytest.raises(ValueError, match="q, k: got heads 1, 1 against v's 2; expected the same"):
        _lower(functools.partial(core, prep=norm), *one_head, *x[2:6])


def test_cute_call_refuses_a_dtype_the_kernel_does_not_take():
    """cute_call checks every buffer's dtype against the kernel's element type (Artifact.dtypes,
    from the export's fake tensors, cached artifacts included): a bf16 gate projection handed to
    a kernel that reads float32 raises, naming the tensor, instead of being read as garbage."""
    from jax_kda.sm90.ffi_call import cute_call

    artifact = sm90.forward_artifact(2, 0.3)
    assert artifact.dtypes[:7] == ("bfloat16",) * 3 + ("float32", "float32", "int32", "float32")
    assert len(artifact.dtypes) == len(artifact.tensors)
    x = [jnp.asarray(a) for a in production_inputs([40], 2, seed=1)]
    results = sm90.result_shapes(40, 2, 1)

    def call(*inputs):
        return cute_call(artifact, list(inputs), results)[0]

    assert re.findall(r'prefix = "(\w+)"', _lower(call, *x)) == [artifact.prefix]
    x[3] = x[3].astype(jnp.bfloat16)
    with pytest.raises(TypeError, match="tensor 3 has dtype bfloat16, the kernel takes float32"):
        _lower(call, *x)


def test_gate_bound_forward_input_prep_variants_export_and_lower_with_their_operands():
    """The gate-bound forward with the inputs prepared in its PREP kernel (InputPrep): a
    variant of its own for each preparation, the gate's taking A_log [H] and dt_bias [H, 128]
    after cu_seqlens; nothing prepared is the plain kernel; the softplus gate (no bound) is
    refused; sm90.forward lowers to one custom call on the raw inputs (dt_bias in fla's flat
    layout too, q and k with their own heads where grouped) and no XLA preparation."""
    from jax_kda.sm90.kernels.input_prep import InputPrep

    plain = sm90.forward_artifact(2, 0.3)
    assert sm90.forward_artifact(2, 0.3, InputPrep()).key == plain.key
    every = InputPrep(qk_l2norm=True, gate=True, lower_bound=-5.0, beta_logits=True)
    norm = InputPrep(qk_l2norm=True)
    grouped = InputPrep(True, True, -5.0, True, grouped_qk=True)
    keys = {plain.key}
    for prep, tag, inputs in ((every, "prepnlb", 9), (norm, "prepn", 7), (grouped, "prepnlbgv", 9)):
        artifact = sm90.forward_artifact(2, 0.3, prep)
        assert artifact.prefix.startswith(f"kda_fwd_sm90_h2_{tag}_"), prep
        assert len(artifact.tensors) == len(plain.tensors) + inputs - 7, prep
        keys.add(artifact.key)
        if prep.gate:
            assert [t.rank for t in artifact.tensors[6:8]] == [1, 2]  # A_log, dt_bias
    assert len(keys) == 4
    with pytest.raises(ValueError, match="take the in-kernel gate only with a lower_bound"):
        sm90.forward_artifact(2, 0.3, InputPrep(gate=True))

    x = production_inputs([100, 0, 30], 2, seed=4)
    a_log, dt_bias = jnp.zeros((2,)), jnp.zeros((2 * 128,))

    def forward(q, k, v, g, beta, cu, state, *params, prep=every):
        gate = dict(zip(("a_log", "dt_bias"), params, strict=False))
        return sm90.forward(q, k, v, g, beta, cu, state, 0.3, prep=prep, **gate)

    hlo = _lower(forward, *x[:6], x.initial_state, a_log, dt_bias)
    prefixes = re.findall(r'prefix = "(\w+)"', hlo)
    assert prefixes == [sm90.forward_artifact(2, 0.3, every).prefix], prefixes
    assert "stablehlo.rsqrt" not in hlo and "stablehlo.logistic" not in hlo  # none in XLA
    with pytest.raises(ValueError, match="with its lower_bound only"):
        _lower(functools.partial(forward, prep=InputPrep(gate=True)), *x[:6], x.initial_state)
    one_head = [t[:, :1] for t in x[:2]]
    hlo = _lower(
        functools.partial(forward, prep=grouped), *one_head, *x[2:6], x.initial_state, a_log,
        dt_bias,
    )  # fmt: skip
    prefixes = re.findall(r'prefix = "(\w+)"', hlo)
    assert prefixes == [sm90.forward_artifact(2, 0.3, grouped).prefix], prefixes
    with pytest.raises(ValueError, match="q, k: got heads 1, 1 against v's 2; expected the same"):
        _lower(functools.partial(forward, prep=norm), *one_head, *x[2:6], x.initial_state)


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus-gate", "safe-gate"])
def test_prefill_hands_raw_inputs_to_the_kernels_only_where_the_route_is_on(
    monkeypatch, lower_bound
):
    """prefill with fla's flags (grouped value heads, H = 2, HV = 4): with
    sm90.backend.IN_KERNEL_PREP (the default) a call that is not differentiated lowers to a
    prep variant on the raw inputs and to no XLA preparation: the chunk core's without a gate
    bound, the gate-bound forward's with the safe gate (its bound picks those kernels);
    differentiated, to the XLA preparation before the plain kernels; with the route off, to
    the XLA preparation and the plain kernels. Every combination takes the route (grouped heads
    alone; the gate and beta without the norm)."""
    from oracle_gradients import prepared_prefill, raw_inputs

    x = raw_inputs([100, 0, 30], 2, 4, seed=6)
    call = prepared_prefill(x, lower_bound, backend="sm90", residuals="saved")
    args = (*x[:5], x.initial_state, x.a_log, x.dt_bias)

    def loss(*args):
        o, final = call(*args)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    def lowered(fn):  # a fresh function: jit's cache would keep the other route's trace
        hlo = _lower(lambda *a: fn(*a), *args)
        prefixes = set(re.findall(r'prefix = "(\w+)"', hlo))
        return prefixes, "stablehlo.rsqrt" in hlo or "stablehlo.logistic" in hlo

    for route in (False, True):
        monkeypatch.setattr(sm90.backend, "IN_KERNEL_PREP", route)
        prefixes, xla_prep = lowered(call)
        prep_core = [p for p in prefixes if "_prep" in p]
        if route:
            expected = "kda_chunk_operands_sm90_x1_fwd_prepnsbgv_"
            if lower_bound is not None:
                expected = "kda_fwd_sm90_h4_prepnlbgv_"
            assert len(prep_core) == 1 and prep_core[0].startswith(expected), prefixes
            assert not xla_prep, prefixes
        else:
            assert not prep_core and xla_prep, prefixes
        prefixes, xla_prep = lowered(jax.grad(loss, argnums=range(8)))
        assert not any("_prep" in p for p in prefixes) and xla_prep, prefixes
        assert "kda_dense_bwd_sm90_hs" in prefixes, prefixes  # the sm90 backward
    # every other combination goes to the kernels too: grouped value heads alone (the chunk
    # core, softplus gate prepared ahead), the safe gate and beta logits without the norm (the
    # gate-bound forward); no preparation at all, to the plain kernels
    q, k = (jnp.asarray(t, jnp.bfloat16) for t in x[:2])
    g = -jax.nn.softplus(jnp.asarray(x.a))
    plain = functools.partial(
        api.prefill, cu_seqlens=jnp.asarray(x.cu_seqlens), scale=0.3, backend="sm90"
    )
    prefixes = set(re.findall(r'prefix = "(\w+)"', _lower(
        lambda *a: plain(*a)[0], q, k, x.v, g, jax.nn.sigmoid(jnp.asarray(x.beta))
    )))  # fmt: skip
    prep_core = [p for p in prefixes if "_prep" in p]
    assert len(prep_core) == 1, prefixes
    assert prep_core[0].startswith("kda_chunk_operands_sm90_x1_fwd_prepgv_"), prefixes
    gate_only = functools.partial(
        plain, use_gate_in_kernel=True, A_log=x.a_log, lower_bound=-5.0,
        use_beta_sigmoid_in_kernel=True,
    )  # fmt: skip
    hlo = _lower(lambda *a: gate_only(*a)[0], q, k, x.v, x.a, x.beta)
    prefixes = set(re.findall(r'prefix = "(\w+)"', hlo))
    assert any(p.startswith("kda_fwd_sm90_h4_preplbgv_") for p in prefixes), prefixes
    assert "stablehlo.logistic" not in hlo and "stablehlo.rsqrt" not in hlo
    same_heads = jnp.repeat(q, 2, axis=1), jnp.repeat(k, 2, axis=1)
    prefixes = set(re.findall(r'prefix = "(\w+)"', _lower(
        lambda *a: plain(*a)[0], *same_heads, x.v, g, jax.nn.sigmoid(jnp.asarray(x.beta))
    )))  # fmt: skip
    assert prefixes and not any("_prep" in p for p in prefixes), prefixes
    assert len(sm90.backend.IN_KERNEL_PREPS) == 15
    assert not sm90.backend.in_kernel_prep(False, False, False, False)


def test_chunk_core_stamps_variant_exports_and_lowers():
    """The chunk core's stamps variant (a diagnostic: every CTA's phase clocks for
    benchmarks/chunk_core_phases.py) writes one more result, int32 [slots, H, len(STAMPS)],
    for both the forward-alone and the training variant, and refuses in-kernel preparation;
    chunk_core_stamps lowers to it alone."""
    from jax_kda.sm90.kernels.kda_chunk_operands_sm90 import PHASES, STAMPS, InputPrep

    assert len(STAMPS) == len(PHASES) + 3
    for residuals in (False, True):
        artifact = sm90.chunk_operands_artifact(0.3, 1, residuals, stamps=True)
        assert artifact.prefix.endswith("_stamps_" + artifact.prefix.rsplit("_", 1)[1])
        assert len(artifact.tensors) == 16 and artifact.tensors[-1].rank == 3
        assert artifact.key != sm90.chunk_operands_artifact(0.3, 1, residuals).key
    with pytest.raises(ValueError, match="stamps=True is a variant of the chunk core without"):
        sm90.chunk_operands_artifact(0.3, 1, False, False, InputPrep(qk_l2norm=True), True)
    x = production_inputs([100, 0, 30], 2, seed=4)
    slots = xla.chunk_slot_count(x.q.shape[0], 3)
    fn = functools.partial(sm90.backend.chunk_core_stamps, num_slots=slots, scale=0.3)
    hlo = _lower(lambda *a: fn(*a), *x[:6])
    assert re.findall(r'prefix = "(\w+)"', hlo) == [
        sm90.chunk_operands_artifact(0.3, 1, False, stamps=True).prefix
    ]


def _prefix(prep):
    return sm90.chunk_operands_artifact(0.3, 1, False, False, prep).prefix


def test_chunk_core_images_variant_exports_and_feeds_the_one_launch_only():
    """The chunk core's variant that writes Qg and Aqk as the scan's operand images (flat) is
    a one-pass forward-alone variant of its own; training_forward(outputs_images=True) takes it,
    with the scan variant that copies them in as they are, exactly where the one launch runs
    (2 heads; 24 heads at 32 columns), not where the two kernels do (40 heads), not in a
    differentiated call, and never by default; the scan wrapper refuses images it cannot
    take."""
    artifact = sm90.chunk_operands_artifact(0.3, 1, False, True)
    assert artifact.object_bytes[:4] == b"\x7fELF"
    assert artifact.prefix.startswith("kda_chunk_operands_sm90_x1_fwd_img_")
    assert artifact.key != sm90.chunk_operands_artifact(0.3, 1, False).key
    qg, attn = (artifact.tensors[i] for i in (7, 8))  # after q, k, v, g, beta, cu, u
    assert (qg.rank, attn.rank) == (3, 3)
    for residuals, passes in ((True, 1), (False, 3)):
        with pytest.raises(ValueError, match="one-pass forward-alone chunk core"):
            sm90.chunk_operands_artifact(0.3, passes, residuals, True)

    def forward(q, k, v, g, beta, cu, state, **options):
        return sm90.training_forward(q, k, v, g, beta, cu, state, 0.3, **options)

    def prefixes(fn, *x):  # the chunk core's without its scale tag
        found = set(re.findall(r'prefix = "(\w+)"', _lower(fn, *x)))
        return {p.rsplit("_", 1)[0] if "chunk_operands" in p else p for p in found}

    for heads, fused in ((2, "t16"), (24, "t32"), (40, None)):
        x = production_inputs([100], heads, seed=9)
        found = prefixes(functools.partial(forward, outputs_images=True), *x)
        if fused:
            assert f"kda_state_scan_sm90_fwd_{fused}x1ofwi" in found, found
            assert "kda_chunk_operands_sm90_x1_fwd_img" in found, found
            assert not any(p.startswith("kda_chunk_outputs_sm90") for p in found), found
        else:
            assert not any(p.endswith(("_img", "wi")) for p in found), found
            assert "kda_chunk_outputs_sm90_hs" in found, found  # on the bf16 states
        assert not any(p.endswith(("_img", "wi")) for p in prefixes(forward, *x)), heads
    with pytest.raises(ValueError, match="outputs_images=True needs outputs_warpgroup=True"):
        sm90.training_forward(*x[:7], 0.3, outputs_images=True, outputs_warpgroup=False)
    for options in ({"chunk_core_passes": 3}, {"dense_precision": "float32"}):
        with pytest.raises(ValueError, match="outputs_images=True needs the chunk-core kernel"):
            sm90.training_forward(*x[:7], 0.3, outputs_images=True, **options)
    x = production_inputs([300, 0, 77], 2, seed=8)

    def loss(q, k, v, g, beta, cu, state):
        o, final = forward(q, k, v, g, beta, cu, state, outputs_images=True)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final**2)

    found = prefixes(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 6)), *x)
    assert "kda_state_scan_sm90_fwd_t16x1ofw" in found, found
    assert not any(p.endswith(("_img", "wi")) for p in found), found
    assert not sm90.scan_outputs_fused(40, 1, 2, 100)
    assert sm90.scan_outputs_fused(2, 1, 2, 100) and not sm90.scan_outputs_fused(2, 1, 0, 0)
    w = jnp.zeros((2, 2, 64 * 128), jnp.bfloat16)
    core = [w, jnp.zeros((2, 2, 64, 128), jnp.bfloat16)]
    with pytest.raises(ValueError, match="serve the one launch only"):
        sm90.state_scan_outputs_kernel(
            w, w, jnp.ones((2, 2, 128)), core[1], jnp.array([0, 100], jnp.int32),
            jnp.zeros((1, 2, 128, 128)), w, jnp.zeros((2, 2, 64 * 64), jnp.bfloat16),
            jnp.zeros((100,), jnp.int32), fuse=False, outputs_warpgroup=True, images=True,
        )  # fmt: skip


def test_the_scan_writes_the_outputs_only_when_asked_and_where_its_ctas_have_an_sm_each():
    """training_forward(fuse_outputs=True, the default) takes the scan with the outputs where
    plan.scan_outputs_v_slice gives a width: 2 heads (16 scan CTAs at 16 columns) yes, 24 heads
    of one sequence at 32 columns (96 CTAs; 192 at 16, more than the 132 SMs), 40 heads not at
    all (160 CTAs even at 32); by default with the O products on a second warpgroup
    (outputs_warpgroup); fuse_outputs=False never; a differentiated call's forward scan stores
    no states where the backward scans them again (both_scans)."""
    from jax_kda.sm90.plan import scan_outputs_v_slice

    assert scan_outputs_v_slice(2, 1, SM_COUNT) == 16
    assert scan_outputs_v_slice(24, 1, SM_COUNT) == 32
    assert scan_outputs_v_slice(40, 1, SM_COUNT) is None
    assert scan_outputs_v_slice(2, 1, None) is None

    def forward(q, k, v, g, beta, cu, state, **options):
        return sm90.training_forward(q, k, v, g, beta, cu, state, 0.3, **options)

    # where the two kernels run, the scan stores the states in bf16 (BF16_STATES) and the
    # outputs kernel's _hs variant reads them so
    for heads, fused in ((2, "t16"), (24, "t32"), (40, None)):
        x = production_inputs([100], heads, seed=9)
        text = _lower(functools.partial(forward, outputs_warpgroup=False), *x)
        assert ('"kda_chunk_outputs_sm90_hs"' in text) == (fused is None), heads
        assert fused is None or f'kda_state_scan_sm90_fwd_{fused}x1of"' in text, heads
        text = _lower(forward, *x)  # the default: the outputs on a warpgroup of their own
        assert ('"kda_chunk_outputs_sm90_hs"' in text) == (fused is None), heads
        assert fused is None or f'kda_state_scan_sm90_fwd_{fused}x1ofw"' in text, heads
        off = functools.partial(forward, fuse_outputs=False, outputs_warpgroup=False)
        text = _lower(off, *x)
        assert "x1o" not in text and '"kda_chunk_outputs_sm90_hs"' in text, heads
    with pytest.raises(ValueError, match="outputs_warpgroup=True needs fuse_outputs=True"):
        sm90.training_forward(*x[:7], 0.3, fuse_outputs=False)
    x = production_inputs([300, 0, 77], 2, seed=8)

    def loss(q, k, v, g, beta, cu, state):
        o, final = forward(q, k, v, g, beta, cu, state)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final**2)

    text = _lower(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 6)), *x)
    assert 'x1ofw"' in text and 'x1ow"' not in text and '"kda_chunk_outputs_sm90"' not in text


@pytest.mark.parametrize("v_slice", [0, *SCAN_TC_V_SLICES])
def test_state_cotangent_exports_for_sm90a(v_slice):
    """The outputs' part of the state cotangent compiles and exports for sm_90a, row-major and
    in each tensor-core scan's slices."""
    artifact = sm90.state_cotangent_artifact(v_slice)
    assert artifact.object_bytes[:4] == b"\x7fELF"
    assert len(artifact.tensors) == 6  # qg, w, attn, d_out, cu_seqlens and d_states
    if not v_slice:
        with pytest.raises(ValueError, match="only in the scan's V slices"):
            sm90.state_cotangent_artifact(0, True)
        return
    bf16 = sm90.state_cotangent_artifact(v_slice, True)  # the reverse scan's bf16 addend
    assert bf16.prefix == f"kda_state_cotangent_sm90_vs{v_slice}h" and bf16.key != artifact.key
    assert bf16.dtypes[-1] == "bfloat16" and artifact.dtypes[-1] == "float32"


@pytest.mark.parametrize("tokens_bwd", [True, False])
def test_training_forward_lowers_to_the_tokens_bwd_kernel_unless_switched_off(tokens_bwd):
    """training_forward's backward ends on the decayed backward with the tokens' backward fused
    after it by default (the two kernels one after the other with fuse_tokens=False), and on the
    decayed kernel then XLA with tokens_bwd=False; without the dense backward it ends, it is
    refused, not dropped."""
    x = production_inputs([300, 0, 77], 2, seed=8)

    def step(q, k, v, g, beta, cu, state, fuse_tokens=True):
        def forward(q, k, v, g, beta, state):
            return sm90.training_forward(
                q, k, v, g, beta, cu, state, 0.3, tokens_bwd=tokens_bwd, fuse_tokens=fuse_tokens
            )

        out, pullback = jax.vjp(forward, q, k, v, g, beta, state)
        return pullback(out)

    if tokens_bwd:
        text = _lower(functools.partial(step, fuse_tokens=False), *x)
        prefixes = {p.rsplit("_", 1)[0] for p in re.findall(r'prefix = "(\w+)"', text)}
        assert {"kda_decayed_bwd_tokens_sm90", "kda_tokens_bwd_sm90"} <= prefixes, prefixes
        assert "kda_decayed_tokens_bwd_sm90" not in prefixes, prefixes
    text = _lower(step, *x)
    prefixes = {p.rsplit("_", 1)[0] for p in re.findall(r'prefix = "(\w+)"', text)}
    assert ("kda_decayed_tokens_bwd_sm90" in prefixes) == tokens_bwd, prefixes
    assert ("kda_decayed_bwd_tokens_sm90" in prefixes) != tokens_bwd, prefixes
    assert "kda_dense_bwd_sm90" in prefixes and "kda_tokens_bwd_sm90" not in prefixes, prefixes
    # the reverse scan's addend straight in the tensor-core scan's slices (t16 at 2 x 3 heads),
    # in bf16 (BF16_ADDEND)
    assert "kda_state_cotangent_sm90_vs16h" in set(re.findall(r'prefix = "(\w+)"', text))
    with pytest.raises(ValueError, match="needs dense_bwd=True"):
        sm90.training_forward(*x[:7], 0.3, dense_bwd=False, tokens_bwd=True)


@pytest.mark.parametrize(
    "dense_precision, ops", [(None, None), ("bf16", None), ("bf16x3", 3), ("float32", None)]
)
def test_training_forward_dense_precision_lowers_to_its_bf16_passes(dense_precision, ops):
    """The forward's dense products (the outputs around the scan) run on a kernel at one bf16
    pass (the default, "bf16": no XLA product left; here in the scan that writes them), as
    three bf16 passes in XLA with dense_precision="bf16x3", at HIGHEST with "float32"; another
    value is refused."""
    x = production_inputs([300, 0, 77], 2, seed=8)
    options = {} if dense_precision is None else {"dense_precision": dense_precision}

    def forward(q, k, v, g, beta, cu, state):
        return sm90.training_forward(q, k, v, g, beta, cu, state, 0.3, **options)

    text = _lower(forward, *x)
    found = set(re.findall(r"num_primitive_operations = (\d+)", text))
    assert found == ({str(ops)} if ops else set())
    on_kernel = dense_precision in (None, "bf16")
    assert ('x1ofw"' in text) == on_kernel
    assert ("stablehlo.dot_general" in text) != on_kernel
    with pytest.raises(ValueError, match="dense_precision is one of"):
        sm90.training_forward(*x[:7], 0.3, dense_precision="tf32")


@pytest.mark.parametrize("n, k, mn_major", [(64, 32, False), (64, 160, False), (64, 320, False),
                                           (128, 32, True), (128, 160, True), (160, 128, False),
                                           (256, 64, True), (64, 64, False), (128, 64, True),
                                           (128, 128, True)])  # fmt: skip
def test_operand_images_take_exactly_their_elements(n, k, mn_major):
    """An operand image of n rows and K = k spans n * k elements. Laid out with 128-byte atoms
    (64 K) alone, K = 32 and 160 images spanned 2x and 1.2x that: a single-pass decayed
    backward's two back-product images overlapped (dk off by 1e12 on the GPU)."""
    import cutlass.cute as cute

    from jax_kda.sm90.kernels.wgmma import image_layout

    spans = []

    @cute.jit
    def measure():
        spans.append(cute.cosize(image_layout(n, k, mn_major).outer))

    measure()
    assert spans == [n * k]


def test_dense_bwd_exports_for_sm90a():
    """The dense products' backward compiles and exports for sm_90a."""
    artifact = sm90.dense_bwd_artifact()
    assert artifact.object_bytes[:4] == b"\x7fELF"
    assert artifact.prefix == "kda_dense_bwd_sm90"
    bf16 = sm90.dense_bwd_artifact(True)  # S in bf16, as the training forward stores it
    assert bf16.prefix == "kda_dense_bwd_sm90_hs" and bf16.key != artifact.key
    assert bf16.dtypes[4] == "bfloat16" and artifact.dtypes[4] == "float32"


@pytest.mark.parametrize("rows, cols", [(128, 128), (64, 128), (64, 256)])
def test_k_major_and_n_major_images_of_one_matrix_share_their_bytes(rows, cols):
    """The dense backward reads one image both ways: written as [rows, cols] K-major (cols
    contiguous), it is read as the N-major image of [cols, rows] (S and G [K, V] as B of W S
    and of the S^T products; dO [64, V] as A and as B of Aqk^T dO; [dW | dV] [64, 256] as B of
    T^-T [dW | dV]). Every element must sit at one offset in both layouts."""
    import cutlass.cute as cute

    from jax_kda.sm90.kernels.wgmma import image_layout

    layouts = []

    @cute.jit
    def build():
        layouts.append(_offsets(image_layout(rows, cols), rows, cols, False))
        layouts.append(_offsets(image_layout(cols, rows, mn_major=True), rows, cols, True))

    build()
    by_row, by_col = layouts
    assert sorted(by_row) == list(range(rows * cols))  # each element its own offset
    assert by_row == by_col


def _offsets(layout, rows, cols, transposed):
    """The offsets of a [rows, cols] matrix's elements in `layout` (static Python ints),
    row by row; transposed: the layout is indexed (col, row). Plain Python: the DSL would
    turn a loop written inside a jit function into a device loop."""
    return [layout((c, r) if transposed else (r, c)) for r in range(rows) for c in range(cols)]


def test_chunk_core_single_pass_fits_two_ctas_an_sm():
    """At one pass the chunk core launches with two CTAs an SM (registers capped at 128 a
    thread): its shared memory, the region first, must fit twice in the H200's 228 KiB less 1
    KiB reserved a CTA."""
    from jax_kda.sm90.kernels import kda_chunk_operands_sm90 as core

    assert 2 * (core.shared_bytes(1) + 1024) <= 228 * 1024
    assert core.shared_bytes(3) + 1024 <= 228 * 1024


def test_chunk_core_single_pass_variant_exports_for_sm90a():
    """The chunk core with one bf16 pass a product compiles and exports as its own variant."""
    artifact = sm90.chunk_operands_artifact(0.3, 1)
    assert artifact.object_bytes[:4] == b"\x7fELF"
    assert artifact.prefix.startswith("kda_chunk_operands_sm90_x1_")
    assert sm90.chunk_operands_artifact(0.3).prefix != artifact.prefix


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_state_scan_single_pass_variants_export_for_sm90a(reverse):
    """The tensor-core scan with one bf16 pass a product exports as its own variant; the SIMT
    scans have none (refused, not ignored)."""
    artifact = sm90.state_scan_artifact(reverse, 16, True, 1)
    assert artifact.object_bytes[:4] == b"\x7fELF"
    assert artifact.prefix.endswith("_t16x1")
    with pytest.raises(ValueError, match="only the tensor-core state scan"):
        sm90.state_scan_artifact(reverse, 16, False, 1)


@pytest.mark.parametrize("passes", [1, 3])
@pytest.mark.parametrize("v_slice", SCAN_TC_V_SLICES)
def test_forward_scan_on_the_plain_addend_exports_and_lowers(v_slice, passes):
    """The forward tensor-core scan that reads the chunk core's bf16 U as it is exports as a
    variant of its own (addend bf16 [slots, H, 64 * 128]); reverse and SIMT scans are refused.
    training_forward(scan_plain_addend=True, the default) lowers to it where the outputs are not
    fused into the scan, and its U then reaches the scan without XLA's float32 V-sliced copy
    (scan_plain_addend=False keeps that copy)."""
    artifact = sm90.state_scan_artifact(False, v_slice, True, passes, True)
    assert artifact.object_bytes[:4] == b"\x7fELF"
    suffix = f"t{v_slice}{'x1' if passes == 1 else ''}u"
    assert artifact.prefix == f"kda_state_scan_sm90_fwd_{suffix}"
    assert artifact.key != sm90.state_scan_artifact(False, v_slice, True, passes).key
    assert len(artifact.tensors) == 8
    for reverse, cores in ((True, True), (False, False)):
        with pytest.raises(ValueError, match="only the forward tensor-core scan"):
            sm90.state_scan_artifact(reverse, v_slice, cores, passes, True)
    x = production_inputs([300, 0, 77], 2, seed=8)

    def forward(q, k, v, g, beta, cu, state, **options):
        return sm90.training_forward(
            q, k, v, g, beta, cu, state, 0.3, scan_v_slice=v_slice, scan_passes=passes,
            fuse_outputs=False, outputs_warpgroup=False, **options,
        )  # fmt: skip

    # XLA's float32 copy of U in the scan's V slices [slots, H, 128 / VS, 64 VS]
    copy = re.compile(rf"stablehlo.convert .*x{128 // v_slice}x{64 * v_slice}xbf16>\) -> ")
    # at one pass the training forward stores the chunk states in bf16 (BF16_STATES)
    states = "h" if passes == 1 else ""
    text = _lower(functools.partial(forward, scan_plain_addend=True), *x)
    assert f'"kda_state_scan_sm90_fwd_{suffix}{states}"' in text and not copy.search(text)
    text = _lower(functools.partial(forward, scan_plain_addend=False), *x)
    assert f'"kda_state_scan_sm90_fwd_{suffix[:-1]}{states}"' in text and copy.search(text)
    if passes == 1:  # a training step: the backward's both scans take U as it is too

        def loss(q, k, v, g, beta, cu, state, **options):
            o, final = forward(q, k, v, g, beta, cu, state, **options)
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final**2)

        grad = jax.grad(functools.partial(loss, scan_plain_addend=True), argnums=(0, 1, 2, 3))
        text = _lower(grad, *x)
        # (and store the chunk states, and read the reverse addend, in bf16)
        assert re.search(r'"kda_state_scans_sm90_t\d+x1uha"', text) and not copy.search(text)


def test_reverse_scan_forming_its_addend_exports_and_lowers_where_asked():
    """The reverse scan that forms its addend on a warpgroup of its own exports at both widths;
    training_forward(fuse_addend=True) with saved chunk states lowers its backward to it in
    place of the state cotangent kernel and the reverse scan (3 heads x 1 sequence: its 24
    CTAs have an SM each); with both_scans or three-pass scans the switch is refused."""
    for v_slice in SCAN_TC_V_SLICES:
        artifact = sm90.backend.reverse_scan_addend_artifact(v_slice)
        assert artifact.prefix == f"kda_state_scan_sm90_rev_t{v_slice}x1a"
        assert artifact.object_bytes[:4] == b"\x7fELF" and len(artifact.tensors) == 10
    with pytest.raises(ValueError, match="v_slice in"):
        sm90.backend.reverse_scan_addend_artifact(64)
    x = production_inputs([300], 3, seed=2)

    def step(q, k, v, g, beta, cu, state, **options):
        def forward(q, k, v, g, beta, state):
            return sm90.training_forward(q, k, v, g, beta, cu, state, 0.3, **options)

        out, pullback = jax.vjp(forward, q, k, v, g, beta, state)
        return pullback(out)

    text = _lower(functools.partial(step, both_scans=False, fuse_addend=True), *x)
    prefixes = set(re.findall(r'prefix = "(\w+)"', text))
    assert "kda_state_scan_sm90_rev_t16x1a" in prefixes, prefixes
    assert not any(p.startswith("kda_state_cotangent") for p in prefixes), prefixes
    text = _lower(functools.partial(step, both_scans=False), *x)  # FUSE_ADDEND off: two kernels
    prefixes = set(re.findall(r'prefix = "(\w+)"', text))
    assert "kda_state_cotangent_sm90_vs16h" in prefixes, prefixes
    for options in ({"fuse_addend": True}, {"both_scans": False, "fuse_addend": True,
                                            "scan_passes": 3}):  # fmt: skip
        with pytest.raises(ValueError, match="fuse_addend needs"):
            sm90.training_forward(*x[:7], 0.3, **options)


@pytest.mark.parametrize(
    "options",
    [{"dense_precision": "bf16x3", "bf16_states": True}, {"scan_passes": 3, "bf16_addend": True}],
    ids=["bf16x3-states", "three-pass-addend"],
)
def test_bf16_states_and_addend_need_the_single_pass_products(options):
    """A training forward that asks for more precision than one bf16 pass refuses the bf16
    chunk states and addend (its defaults keep them float32 there)."""
    x = production_inputs([70], 2, seed=1)
    q, k, v, g, beta, cu, state = (jnp.asarray(a) for a in x)
    with pytest.raises(ValueError, match="bf16_states and bf16_addend need"):
        sm90.training_forward(q, k, v, g, beta, cu, state, 0.3, **options)


@pytest.mark.parametrize("v_slice", SCAN_TC_V_SLICES)
def test_bf16_states_and_addend_variants_export_and_refuse_the_other_direction(v_slice):
    """The training path's scans on bf16 chunk states (BF16_STATES: the forward scans store
    them so) and a bf16 reverse addend (BF16_ADDEND: the reverse scan reads it so) are variants
    of their own, with those tensors' dtypes; the other direction, the SIMT scan and a scan
    that stores no states refuse them."""
    fwd = sm90.state_scan_artifact(False, v_slice, True, 1, True, True)
    assert fwd.prefix == f"kda_state_scan_sm90_fwd_t{v_slice}x1uh"
    assert fwd.dtypes[6] == "bfloat16" and fwd.dtypes[7] == "float32"  # states, final
    rev = sm90.state_scan_artifact(True, v_slice, True, 1, False, False, True)
    assert rev.prefix == f"kda_state_scan_sm90_rev_t{v_slice}x1h"
    assert rev.dtypes[3] == "bfloat16" and rev.dtypes[6] == "float32"  # addend, g_end
    # the training backward's: y0 and final in prefill's [V, K] layout as well
    rev_vk = sm90.state_scan_artifact(True, v_slice, True, 1, False, False, True, True)
    assert rev_vk.prefix == f"kda_state_scan_sm90_rev_t{v_slice}x1hk"
    with pytest.raises(ValueError, match="state_vk=True needs reverse=True and tensor_cores"):
        sm90.state_scan_artifact(False, v_slice, True, 1, False, False, False, True)
    outs = sm90.state_scan_outputs_artifact(v_slice, True, True, False, True)
    assert outs.prefix == f"kda_state_scan_sm90_fwd_t{v_slice}x1owh"
    assert outs.dtypes[8] == "bfloat16"  # states
    both = sm90.state_scans_artifact(v_slice, True, True, True)
    assert both.prefix == f"kda_state_scans_sm90_t{v_slice}x1uha"
    assert both.dtypes[4] == both.dtypes[8] == "bfloat16"  # d_states (the addend), states
    assert both.dtypes[10] == "float32"  # g_end
    for artifact in (fwd, rev, rev_vk, outs, both):
        assert artifact.object_bytes[:4] == b"\x7fELF"
    with pytest.raises(ValueError, match="only the forward tensor-core scan stores"):
        sm90.state_scan_artifact(True, v_slice, True, 1, False, True)
    with pytest.raises(ValueError, match="only the reverse tensor-core scan reads"):
        sm90.state_scan_artifact(False, v_slice, True, 1, True, False, True)
    with pytest.raises(ValueError, match="only the forward tensor-core scan stores"):
        sm90.state_scan_artifact(False, 32, False, 3, False, True)
    with pytest.raises(ValueError, match="stores no chunk states"):
        sm90.state_scan_outputs_artifact(v_slice, False, True, False, True)


@pytest.mark.parametrize("v_slice", [16, 32])
def test_both_state_scans_export_for_sm90a(v_slice):
    """The backward's two scans in one launch (single-pass tensor-core scans)."""
    artifact = sm90.state_scans_artifact(v_slice)
    assert artifact.object_bytes[:4] == b"\x7fELF"
    assert len(artifact.tensors) == 12  # 8 inputs (both directions), 4 results
    plain = sm90.state_scans_artifact(v_slice, True)  # U bf16 as the chunk core stores it
    assert plain.prefix == f"kda_state_scans_sm90_t{v_slice}x1u" and plain.key != artifact.key
    assert len(plain.tensors) == 12
    with pytest.raises(ValueError, match="tensor cores"):
        sm90.state_scans_artifact(64)


def test_grad_lowers_to_the_backward_kernels_and_no_loop():
    """jax.grad on the sm90 path: the forward kernel, both state scans in one launch (the
    recompute's forward and the reverse), and no XLA while loop (the serial passes are all in
    kernels). The recompute's outputs (its forward scan and outputs kernel) are in the lowered
    program as dead code that XLA drops when it compiles."""
    x = production_inputs([300, 0, 77], 2, seed=5)

    def loss(q, k, v, g, beta, cu, state):
        o, final = _prefill(backend="sm90")(q, k, v, g, beta, cu, state)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final**2)

    text = _lower(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 6)), *x)
    prefixes = re.findall(r'prefix = "(\w+)"', text)
    assert any(p.startswith("kda_fwd_sm90_") for p in prefixes), prefixes
    # the tensor-core scan at one bf16 pass a product, the backward's default
    # on the chunk core's bf16 U, the chunk states stored and the reverse addend read in bf16
    assert "kda_state_scans_sm90_t16x1uha" in prefixes
    assert not any(p.startswith("kda_state_scan_sm90_rev") for p in prefixes), prefixes
    assert "kda_dense_bwd_sm90_hs" in prefixes  # the products around the scan, backward
    assert "stablehlo.while" not in text


def test_grad_with_saved_residuals_lowers_without_a_recompute():
    """With saved residuals the gradient's forward is the exact 64-token one (chunk core, then
    the forward scan that writes the outputs and stores the chunk states: no gate-bound forward
    kernel even with a bound) and its backward recomputes nothing: one chunk-core call, the
    reverse scan alone. Under vmap each element is its own call (a loop)."""
    x = production_inputs([300, 0, 77], 2, seed=5)

    def loss(q, k, v, g, beta, cu, state):
        o, final = _prefill(backend="sm90", residuals="saved")(q, k, v, g, beta, cu, state)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final**2)

    def batched(q, k, v, g, beta, state):
        def one(q, k, v, g, beta, state):
            o, final = api.prefill(
                q,
                k,
                v,
                g,
                beta,
                initial_state=state[None],
                backend="sm90",
                gate_lower_bound=-5.0,
            )  # fmt: skip (the default residuals, "saved")
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

        return jnp.sum(jax.vmap(one)(q, k, v, g, beta, state))

    rows = [a[:128].reshape(2, 64, *a.shape[1:]) for a in x[:5]]
    cases = {
        "grad": (jax.grad(loss, argnums=(0, 1, 2, 3, 4, 6)), x),
        "vmap": (jax.grad(batched, argnums=range(6)), (*rows, x.initial_state[:2])),
    }
    for name, (fn, args) in cases.items():
        text = _lower(fn, *args)
        prefixes = re.findall(r'prefix = "(\w+)"', text)
        expected = {  # the chunk core without gamma (_ng): the fused backward sums g itself
            "kda_chunk_operands_sm90_x1_ng", "kda_state_scan_sm90_fwd", "kda_state_cotangent_sm90",
            "kda_state_scan_sm90_rev", "kda_dense_bwd_sm90", "kda_decayed_tokens_bwd_sm90",
        }  # fmt: skip
        assert {p.rsplit("_", 1)[0] for p in prefixes} == expected, (name, prefixes)
        # the forward scan writes the outputs and stores the chunk states the backward takes,
        # in bf16 (BF16_STATES: the dense backward's _hs variant reads them so); the state
        # cotangent writes the reverse scan's addend in bf16 (BF16_ADDEND), which it reads so
        assert any(p.endswith("x1owh") for p in prefixes), (name, prefixes)
        assert "kda_dense_bwd_sm90_hs" in prefixes, (name, prefixes)
        assert any(p.startswith("kda_state_cotangent_sm90_vs") and p.endswith("h")
                   for p in prefixes), (name, prefixes)  # fmt: skip
        # and it takes d_final and gives d_initial_state in prefill's layout (k): no transposes
        assert any(p.startswith("kda_state_scan_sm90_rev") and p.endswith("hk")
                   for p in prefixes), (name, prefixes)  # fmt: skip
        assert sum(p.startswith("kda_chunk_operands_sm90") for p in prefixes) == 1, name
        assert name == "vmap" or "stablehlo.while" not in text, name


def test_training_forward_variants_lower_to_their_kernels():
    """The backward's variants under development (benchmarks.kernel_profile --train-variants):
    the chunk-core kernel's operands, their backward's decayed products, the SIMT state scan
    and the tokens' backward lower for CUDA, both directions of the scan, and no XLA loop."""
    x = production_inputs([300, 0, 77], 2, seed=8)

    def step(q, k, v, g, beta, cu, state):
        def forward(q, k, v, g, beta, state):
            return sm90.training_forward(
                q, k, v, g, beta, cu, state, 0.3, chunk_core=True, decayed_bwd=True,
                scan_v_slice=64, dense_precision="bf16x3", chunk_core_passes=3,
            )  # fmt: skip

        out, pullback = jax.vjp(forward, q, k, v, g, beta, state)
        return pullback(out)

    text = _lower(step, *x)
    prefixes = set(re.findall(r'prefix = "(\w+)"', text))
    # the XLA dense backward's float32 outputs: the float32 variants of the kernels after it
    assert {p.rsplit("_", 1)[0] for p in prefixes} == {
        "kda_chunk_operands_sm90",
        "kda_decayed_bwd_tokens_sm90_f32",
        "kda_state_scan_sm90_fwd",
        "kda_state_scan_sm90_rev",
        "kda_tokens_bwd_sm90_f32",
    }, prefixes
    assert {"kda_state_scan_sm90_fwd_v64", "kda_state_scan_sm90_rev_v64"} <= prefixes
    assert "stablehlo.while" not in text


def test_training_lowers_under_scan_over_layers_checkpoint_and_vmap():
    """A model's training step: layers in lax.scan, each rematerialised (jax.checkpoint), and a
    vmapped batch; every form lowers to the forward kernel, the chunk-core kernel, both
    state-scan kernels and the three backward kernels (dense, decayed, tokens)."""
    x = production_inputs([130, 0, 60], 2, seed=6)
    layer = _prefill(backend="sm90")

    def layers(q, k, v, g, beta, cu, state):
        @jax.checkpoint
        def body(s, _):
            o, final = layer(q, k, v, g, beta, cu, s)
            return final, jnp.sum(o.astype(jnp.float32))

        final, sums = jax.lax.scan(body, state, None, length=3)
        return jnp.sum(sums) + jnp.sum(final)

    def batched(q, k, v, g, beta, state):
        def one(q, k, v, g, beta, state):
            o, final = jax_kda.prefill(
                q, k, v, g, beta, initial_state=state[None], backend="sm90",
                gate_lower_bound=-5.0,
            )  # fmt: skip
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

        return jnp.sum(jax.vmap(one)(q, k, v, g, beta, state))

    rows = [a[:128].reshape(2, 64, *a.shape[1:]) for a in x[:5]]
    cases = {
        "scan+checkpoint": (jax.value_and_grad(layers, argnums=(0, 1, 2, 3, 4, 6)), x),
        "vmap": (jax.value_and_grad(batched, argnums=range(6)), (*rows, x.initial_state[:2])),
    }
    for name, (fn, args) in cases.items():
        prefixes = set(re.findall(r'prefix = "(\w+)"', _lower(fn, *args)))
        kinds = {p.rsplit("_", 1)[0] for p in prefixes}
        expected = {"kda_fwd_sm90_h2", "kda_chunk_operands_sm90_x1_ng"}
        expected |= {"kda_decayed_tokens_bwd_sm90", "kda_dense_bwd_sm90"}
        expected |= {"kda_state_scan_sm90_fwd", "kda_state_scans_sm90"}
        expected |= {"kda_state_cotangent_sm90"}
        assert kinds == expected, (
            name,
            prefixes,
        )


def test_cache_key_covers_every_source_the_kernels_import():
    """The disk cache would hand back a stale object if a kernel imported a module the key does
    not hash: every jax_kda module a kernel source imports must be among kernel_sources()."""
    sources = {p.resolve() for p in cute_export.kernel_sources()}
    names = {p.name for p in sources}
    assert {"layout.py", "constants.py", "kda_fwd_sm90.py", "kda_state_scan_sm90.py"} <= names
    root = Path(jax_kda.__file__).resolve().parent.parent
    for path in cute_export.KERNELS_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax_kda"):
                module = root / (node.module.replace(".", "/") + ".py")
                package = root / node.module.replace(".", "/") / "__init__.py"
                assert module.resolve() in sources or package.resolve() in sources, (
                    f"{path.name} imports {node.module}, which the cache key does not hash"
                )


def test_cache_key_changes_with_any_kernel_source(monkeypatch, tmp_path):
    config = {"x": 1}
    before = cute_export.artifact_key(config)
    edited = tmp_path / "constants.py"
    edited.write_text(Path(cute_export.constants.__file__).read_text() + "\n# edited\n")
    sources = [p for p in cute_export.kernel_sources() if p.name != "constants.py"]
    monkeypatch.setattr(cute_export, "kernel_sources", lambda: [*sources, edited])
    assert cute_export.artifact_key(config) != before


def test_the_ffi_source_ships_with_the_package():
    from jax_kda.sm90 import ffi_build

    assert ffi_build.SOURCE.is_relative_to(Path(jax_kda.__file__).resolve().parent)
    assert "XLA_FFI_DEFINE_HANDLER" in ffi_build.SOURCE.read_text()


def test_a_new_process_loads_the_kernel_from_disk_without_compiling(tmp_path):
    script = textwrap.dedent(
        """
        import time
        t = time.perf_counter()
        from jax_kda import sm90
        from jax_kda.sm90 import export as cute_export
        sm90.forward_artifact(3, 128 ** -0.5)
        print(cute_export.COMPILE_COUNT, f"{time.perf_counter() - t:.2f}")
        """
    )
    env = {**os.environ, "JAX_KDA_CACHE_DIR": str(tmp_path), "CUTE_DSL_ARCH": "sm_90a"}
    runs = [
        subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    (cold, cold_s), (warm, warm_s) = (run.stdout.split() for run in runs)
    print(f"kernel ready: cold process {cold_s} s ({cold} compile), warm {warm_s} s ({warm})")
    assert (cold, warm) == ("1", "0")


@pytest.mark.parametrize("value", ["abc", "0", "-4", "1.5"])
def test_malformed_sm_count_variable_is_named(monkeypatch, value):
    monkeypatch.setenv(sm90.SM_COUNT_ENV, value)
    with pytest.raises(ValueError, match=rf"\$JAX_KDA_SM_COUNT: got '{re.escape(value)}'"):
        sm90.device_sm_count()


def test_symbolic_token_count_exports_on_xla_and_sm90_says_why_not():
    """jax.export with a symbolic T on a Hopper: "auto" exports the XLA path (the kernels plan
    their launch from concrete sizes), and an explicit "sm90" raises with the reason."""
    from jax import export

    (tokens,) = export.symbolic_shape("T")
    shapes = [jax.ShapeDtypeStruct((tokens, 2, 128), jnp.bfloat16)] * 3
    shapes += [
        jax.ShapeDtypeStruct((tokens, 2, 128), jnp.float32),
        jax.ShapeDtypeStruct((tokens, 2), jnp.float32),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        jax.ShapeDtypeStruct((3, 2, 128, 128), jnp.float32),
    ]
    exported = export.export(jax.jit(_prefill()), platforms=["cuda"])(*shapes)
    assert TARGET not in exported.mlir_module()
    with pytest.raises(jax_kda.BackendUnavailableError, match="T=T is symbolic"):
        export.export(jax.jit(_prefill(backend="sm90")), platforms=["cuda"])(*shapes)


def _run_on_host_devices(script: str, devices: int) -> None:
    """Run `script` in a fresh process with `devices` host devices, lowering for sm_90a (the
    device count is fixed at JAX's start); it must print "ok" last."""
    env = host_devices(devices, JAX_PLATFORMS="cpu", CUTE_DSL_ARCH="sm_90a")
    env.update({sm90.ASSUME_SM90_ENV: "1", sm90.SM_COUNT_ENV: str(SM_COUNT)})
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_grad_under_shard_map_with_check_vma_lowers():
    """jax.grad of the sm90 path under shard_map over heads and over sequences (the batched
    form's rows; default check_vma), four host devices lowering for CUDA, in a fresh process:
    the custom calls' outputs are typed varying like their inputs, so the backward's pullback
    takes their cotangents (an output typed invariant made it raise a type mismatch)."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        import jax_kda
        from jax_kda.oracle import production_inputs

        mesh = Mesh(np.array(jax.devices()), ("x",))
        x = production_inputs([100, 0, 30, 64], 4, seed=3)
        cu = jnp.asarray(x.cu_seqlens)

        def heads(q, k, v, g, beta, state):
            return jax_kda.prefill(q, k, v, g, beta, cu_seqlens=cu, initial_state=state,
                                   backend="sm90", gate_lower_bound=-5.0,
                                   residuals="recompute")

        spec = P(None, "x")
        by_heads = jax.shard_map(heads, mesh=mesh, in_specs=(spec,) * 6, out_specs=(spec, spec))

        def loss(*a):
            o, final = by_heads(*a)
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

        grad = jax.jit(jax.grad(loss, argnums=range(6)))
        text = grad.trace(*x[:5], x.initial_state).lower(lowering_platforms=("cuda",)).as_text()
        assert "kda_state_scans_sm90" in text and "kda_fwd_sm90" in text

        # sequences: the batched [B, T, H, 128] form, rows sharded over the devices
        rows = production_inputs([48] * 4, 2, seed=4)
        batched = [a.reshape(4, 48, *a.shape[1:]) for a in rows[:5]]

        def sequences(q, k, v, g, beta, state):
            return jax_kda.prefill(q, k, v, g, beta, initial_state=state, backend="sm90",
                                   gate_lower_bound=-5.0, residuals="recompute")

        by_rows = jax.shard_map(sequences, mesh=mesh, in_specs=(P("x"),) * 6,
                                out_specs=(P("x"), P("x")))

        def row_loss(*a):
            o, final = by_rows(*a)
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

        grad = jax.jit(jax.grad(row_loss, argnums=range(6)))
        text = grad.trace(*batched, rows.initial_state).lower(lowering_platforms=("cuda",))
        assert "kda_state_scans_sm90" in text.as_text()
        print("ok")
        """
    )
    _run_on_host_devices(script, 4)


def test_decode_under_shard_map_with_check_vma_lowers():
    """The decode kernel under shard_map over value heads and over sequences (a pool's rows by
    index; default check_vma), with its gradient, four host devices lowering for CUDA in a
    fresh process: the kernel runs inside the per-device computation, its outputs typed
    varying like its inputs."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        import jax_kda

        mesh = Mesh(np.array(jax.devices()), ("x",))
        rng = np.random.default_rng(5)
        n, heads = 8, 4
        q, k, v = (jnp.asarray(rng.standard_normal((n, heads, 128)), jnp.bfloat16)
                   for _ in range(3))
        g = jnp.asarray(-rng.random((n, heads, 128)), jnp.float32)
        beta = jnp.asarray(rng.random((n, heads)), jnp.float32)
        state = jnp.asarray(rng.standard_normal((n, heads, 128, 128)), jnp.float32)

        def step(q, k, v, g, beta, state):
            return jax_kda.decode(q, k, v, g, beta, state, backend="sm90")

        spec = P(None, "x")
        by_heads = jax.shard_map(step, mesh=mesh, in_specs=(spec,) * 6, out_specs=(spec, spec))

        def loss(*a):
            o, new_state = by_heads(*a)
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(new_state ** 2)

        text = jax.jit(jax.value_and_grad(loss, argnums=range(6))).trace(
            q, k, v, g, beta, state).lower(lowering_platforms=("cuda",)).as_text()
        assert "kda_decode_sm90_" in text

        # sequences sharded, each device with its own pool of 3 rows per sequence it holds
        pool = jnp.zeros((3 * n, heads, 128, 128), jnp.float32)
        rows = jnp.asarray(np.tile([2, 0], n // 2), jnp.int32)  # rows of each device's pool

        def pooled(q, k, v, g, beta, pool, rows):
            return jax_kda.decode(q, k, v, g, beta, pool, state_indices=rows, backend="sm90")

        by_rows = jax.shard_map(pooled, mesh=mesh, in_specs=(P("x"),) * 7,
                                out_specs=(P("x"), P("x")))
        text = jax.jit(by_rows).trace(q, k, v, g, beta, pool, rows).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "kda_decode_sm90_pool_" in text
        print("ok")
        """
    )
    _run_on_host_devices(script, 4)


def test_grad_under_explicit_sharding_lowers_per_device():
    """jax.grad of the sm90 path under jax.set_mesh with Explicit axes, rows sharded, lowering
    for CUDA on two host devices in a fresh process: every kernel inside the per-device
    (manual) computation, so the partitioner never gathers the kernels' inputs."""
    script = textwrap.dedent(
        """
        import re
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        import jax_kda
        from jax_kda.oracle import production_inputs

        mesh = jax.make_mesh((2,), ("b",))
        x = production_inputs([64] * 4, 2, seed=1)
        rows = (*(a.reshape(4, 64, *a.shape[1:]) for a in x[:5]), x.initial_state)

        def loss(*a):
            o, final = jax_kda.prefill(*a[:5], initial_state=a[5], backend="sm90",
                                       gate_lower_bound=-5.0, residuals="recompute")
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

        with jax.set_mesh(mesh):
            sharded = [jax.device_put(a, NamedSharding(mesh, P("b"))) for a in rows]
            grad = jax.jit(jax.grad(loss, argnums=range(6)))
            text = grad.trace(*sharded).lower(lowering_platforms=("cuda",)).as_text()
        kinds = {p.rsplit("_", 1)[0] for p in re.findall(r'prefix = "(\\w+)"', text)}
        assert {"kda_fwd_sm90", "kda_chunk_operands_sm90_x1_ng", "kda_decayed_tokens_bwd_sm90"} <= {
            k.rsplit("_", 1)[0] if k.startswith("kda_fwd") else k for k in kinds}, kinds
        assert "manual_computation" in text
        assert "stablehlo.while" not in text
        print("ok")
        """
    )
    _run_on_host_devices(script, 2)


def test_context_parallel_grad_lowers_per_device():
    """jax.grad of jax_kda.parallel.prefill_on_mesh on the sm90 backend, tokens of packed
    sequences split over two host devices, lowering for CUDA in a fresh process: the kernels
    run inside the per-device computation, the pairs cross devices by all_gather, the final
    states by all_reduce, and the fold of the pairs is unrolled (no device-side loop)."""
    script = textwrap.dedent(
        """
        import re
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh
        from jax_kda import parallel
        from jax_kda.oracle import production_inputs

        mesh = Mesh(np.array(jax.devices()), ("tokens",))
        x = production_inputs([100, 0, 156], 2, seed=2)

        def loss(q, k, v, g, beta, state):
            o, final = parallel.prefill_on_mesh(
                q, k, v, g, beta, cu_seqlens=x.cu_seqlens, initial_state=state, mesh=mesh,
                token_axis="tokens", backend="sm90", gate_lower_bound=-5.0,
                                   residuals="recompute")
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

        grad = jax.jit(jax.grad(loss, argnums=range(6)))
        text = grad.trace(*x[:5], x.initial_state).lower(lowering_platforms=("cuda",)).as_text()
        kinds = {p.rsplit("_", 1)[0] for p in re.findall(r'prefix = "(\\w+)"', text)}
        # the forward runs both passes as one call on twice the heads (h4)
        expected = {"kda_fwd_sm90_h4", "kda_state_scans_sm90", "kda_decayed_tokens_bwd_sm90"}
        assert expected <= kinds, kinds
        assert "manual_computation" in text and "stablehlo.all_gather" in text
        assert "stablehlo.all_reduce" in text and "stablehlo.while" not in text
        print("ok")
        """
    )
    _run_on_host_devices(script, 2)


def _vmapped_calls():
    """Three packed calls of two sequences each, stacked for jax.vmap; and a loss."""
    xs = [production_inputs([40, 24], 2, seed=20 + i) for i in range(3)]
    stacked = [jnp.stack([jnp.asarray(x[i]) for x in xs]) for i in range(7)]
    prefill = _prefill(backend="sm90")

    def loss(q, k, v, g, beta, cu, state):
        o, final = prefill(q, k, v, g, beta, cu, state)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final**2)

    return stacked, prefill, loss


def test_vmap_runs_the_sm90_path_as_one_call():
    """jax.vmap of the sm90 path, its gradient and a vmapped gradient each lower to one call of
    every kernel (the batch packed as sequences) and no XLA loop."""
    stacked, prefill, loss = _vmapped_calls()
    grads = jax.grad(loss, argnums=range(5))
    cases = {
        "vmap": jax.vmap(prefill),
        "grad of vmap": jax.grad(lambda *a: jax.vmap(loss)(*a).sum(), argnums=range(5)),
        "vmap of grad": jax.vmap(grads),
    }
    for name, fn in cases.items():
        text = _lower(fn, *stacked)
        prefixes = re.findall(r'prefix = "(\w+)"', text)
        kinds = sorted(p.rsplit("_", 1)[0] for p in prefixes)
        expected = ["kda_fwd_sm90"] if name == "vmap" else [
            "kda_chunk_operands_sm90_x1_ng", "kda_decayed_tokens_bwd_sm90", "kda_dense_bwd_sm90",
            "kda_fwd_sm90", "kda_state_cotangent_sm90", "kda_state_scan_sm90_fwd",
            "kda_state_scans_sm90",
        ]  # fmt: skip
        assert [k.rsplit("_", 1)[0] if k.startswith("kda_fwd") else k for k in kinds] == expected
        assert "stablehlo.while" not in text, name


def test_vmap_packing_gives_the_per_element_results(monkeypatch):
    """The vmap rule's packing (sequences at offsets v * T, states and gradients split back),
    run on the CPU with the XLA path standing in for the kernels: equal to one call per batch
    element, for outputs, the gradient of a vmap and a vmapped gradient, packed and batched."""
    from jax_kda import xla

    def stand_in(q, k, v, g, beta, cu, state, scale, **_):
        return xla.forward(q, k, v, g, beta, cu, state, scale)

    monkeypatch.setattr(sm90, "forward", stand_in)
    monkeypatch.setattr(sm90, "training_forward", stand_in)
    stacked, prefill, loss = _vmapped_calls()
    stacked = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in stacked]
    stacked[:3] = [a.astype(jnp.bfloat16) for a in stacked[:3]]
    per_element = [prefill(*(a[i] for a in stacked)) for i in range(3)]
    vmapped = jax.jit(jax.vmap(prefill))(*stacked)
    for got, want in zip(vmapped, zip(*per_element, strict=True), strict=True):
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(jnp.stack(want), np.float32), rtol=1e-5,
            atol=1e-6,
        )  # fmt: skip
    grads = jax.grad(loss, argnums=range(5))
    want = [grads(*(a[i] for a in stacked)) for i in range(3)]
    want = [np.stack([np.asarray(w[j], np.float32) for w in want]) for j in range(5)]
    for got in (
        jax.jit(jax.grad(lambda *a: jax.vmap(loss)(*a).sum(), argnums=range(5)))(*stacked),
        jax.jit(jax.vmap(grads))(*stacked),
    ):
        for g_, w_ in zip(got, want, strict=True):
            # float32 sums in another order: bfloat16 gradients may round one ulp apart
            rtol = 8e-3 if g_.dtype == jnp.bfloat16 else 1e-4
            np.testing.assert_allclose(np.asarray(g_, np.float32), w_, rtol=rtol, atol=1e-6)


def test_vmap_packing_of_the_batched_form(monkeypatch):
    """The same for calls of the batched [B, T, H, 128] form: V calls of B rows are V * B rows."""
    from jax_kda import xla

    def stand_in(q, k, v, g, beta, cu, state, scale, **_):
        return xla.forward(q, k, v, g, beta, cu, state, scale)

    monkeypatch.setattr(sm90, "forward", stand_in)
    x = production_inputs([32] * 6, 2, seed=30)
    rows = [jnp.asarray(a).reshape(3, 2, 32, *a.shape[1:]) for a in x[:5]]
    states = jnp.asarray(x.initial_state).reshape(3, 2, *x.initial_state.shape[1:])

    def call(q, k, v, g, beta, state):
        return jax_kda.prefill(q, k, v, g, beta, initial_state=state, backend="sm90",
                               gate_lower_bound=-5.0)  # fmt: skip

    vmapped = jax.jit(jax.vmap(call))(*rows, states)
    for i in range(3):
        o, final = call(*(a[i] for a in rows), states[i])
        np.testing.assert_allclose(np.asarray(vmapped[0][i], np.float32),
                                   np.asarray(o, np.float32), rtol=8e-3, atol=1e-6)  # fmt: skip
        np.testing.assert_allclose(np.asarray(vmapped[1][i]), np.asarray(final), rtol=1e-5,
                                   atol=1e-6)  # fmt: skip


def test_vmap_edge_cases_lower():
    """An empty vmapped batch lowers (no call); vmap of vmap packs both levels (no XLA loop);
    a symbolic head count exports the XLA path under "auto"."""
    stacked, prefill, loss = _vmapped_calls()
    text = _lower(jax.vmap(prefill), *(a[:0] for a in stacked))
    assert "stablehlo.while" not in text
    nested = [jnp.stack([a, a]) for a in stacked]
    for fn in (
        jax.vmap(jax.vmap(prefill)),
        jax.grad(lambda *a: jax.vmap(jax.vmap(loss))(*a).sum(), argnums=range(5)),
    ):
        text = _lower(fn, *nested)
        assert "stablehlo.while" not in text and TARGET in text
    from jax import export

    (heads,) = export.symbolic_shape("H")
    shapes = [jax.ShapeDtypeStruct((40, heads, 128), jnp.bfloat16)] * 3
    shapes += [
        jax.ShapeDtypeStruct((40, heads, 128), jnp.float32),
        jax.ShapeDtypeStruct((40, heads), jnp.float32),
        jax.ShapeDtypeStruct((2,), jnp.int32),
        jax.ShapeDtypeStruct((1, heads, 128, 128), jnp.float32),
    ]
    exported = export.export(jax.jit(_prefill()), platforms=["cuda"])(*shapes)
    assert TARGET not in exported.mlir_module()


def test_chunk_states_past_32_bit_indexing_are_refused():
    """The state-scan kernel indexes its chunk states in 32 bits: a call whose states would pass
    that gets a reason (the no-bound forward and the backward use them); 262144 tokens of 32
    heads in one sequence are 4097 slots (T / 64 + N) x 32 heads x 128 x 128 > 2^31 elements,
    eight chunks fewer fit."""
    assert sm90.scan_unavailable_reason(262144, 32, 1) is not None
    assert sm90.scan_unavailable_reason(262144 - 64 * 8, 32, 1) is None


def _decode_inputs(n, heads, value_heads, pool_rows=None, dtype=jnp.bfloat16):
    rng = np.random.default_rng(7)
    q, k = (jnp.asarray(rng.standard_normal((n, heads, 128)), dtype) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((n, value_heads, 128)), dtype)
    g = jnp.asarray(-rng.random((n, value_heads, 128)), jnp.float32)
    beta = jnp.asarray(rng.random((n, value_heads)), jnp.float32)
    state = jnp.zeros((pool_rows or n, value_heads, 128, 128), jnp.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("pooled", [False, True], ids=["dense", "pool"])
def test_decode_exports_and_lowers_to_its_kernel(pooled):
    """The decode step's kernel compiles for sm_90a (dense state and pool); a jitted step lowers
    to one custom call with the state aliased to its result, its gradient to the XLA step's
    pullback, and jax.vmap to one call on the folded batch."""
    artifact = sm90.decode_artifact(0.25, pooled)
    assert artifact.object_bytes[:4] == b"\x7fELF"
    assert artifact.prefix.startswith("kda_decode_sm90_" + ("pool_" if pooled else ""))
    x = _decode_inputs(3, 1, 2, pool_rows=5 if pooled else None)
    indices = jnp.asarray([4, -1, 0], jnp.int32) if pooled else None

    def step(*a):
        return jax_kda.decode(*a, scale=0.25, state_indices=indices, backend="sm90")

    text = _lower(step, *x)
    assert text.count('prefix = "kda_decode_sm90') == 1
    assert "output_operand_alias<output_tuple_indices = [0], operand_index = 6" in text
    loss = lambda *a: jnp.sum(step(*a)[0].astype(jnp.float32))  # noqa: E731
    assert "kda_decode_sm90" in _lower(jax.value_and_grad(loss, argnums=range(6)), *x)
    batched = [jnp.stack([a, a]) for a in x]
    text = _lower(jax.vmap(step), *batched)
    assert text.count('prefix = "kda_decode_sm90') == 1, "vmap: one call on the folded batch"


def test_decode_backend_choice_and_errors():
    """auto takes the kernel for bfloat16 and plain JAX for float32; an explicit sm90 call the
    kernel cannot serve says why; an unknown backend is named."""
    x = _decode_inputs(2, 1, 1)
    assert TARGET in _lower(lambda *a: jax_kda.decode(*a), *x)
    x32 = _decode_inputs(2, 1, 1, dtype=jnp.float32)
    assert TARGET not in _lower(lambda *a: jax_kda.decode(*a), *x32)
    assert TARGET not in _lower(lambda *a: jax_kda.decode(*a, backend="xla"), *x)
    with pytest.raises(jax_kda.BackendUnavailableError, match="bfloat16 q, k, v; got float32"):
        jax_kda.decode(*x32, backend="sm90")
    with pytest.raises(ValueError, match="backend: got 'cuda'"):
        jax_kda.decode(*x, backend="cuda")


def test_decode_limits_under_vmap_and_for_the_tokens():
    """The decode kernel's 32-bit limits: a vmapped batch whose folded pool would pass them runs
    the kernel once per element (a loop), an empty batch lowers too, and a pooled step whose
    tokens alone pass them (N * HV * 128 elements, whatever the pool) is refused by name."""
    spec = jax.ShapeDtypeStruct
    bf16, f32 = jnp.bfloat16, jnp.float32

    def step(q, k, v, g, beta, pool, rows):
        return jax_kda.decode(q, k, v, g, beta, pool, state_indices=rows, backend="sm90")

    def batch(size, rows_per_pool):
        token = [spec((size, 2, 2, 128), dtype) for dtype in (bf16, bf16, bf16, f32)]
        return (*token, spec((size, 2, 2), f32), spec((size, rows_per_pool, 2, 128, 128), f32),
                spec((size, 2), jnp.int32))  # fmt: skip

    big = batch(2, 40000)  # each pool 2.6e9 / 2 elements: one fits, the two folded do not
    text = jax.jit(jax.vmap(step)).trace(*big).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count('prefix = "kda_decode_sm90_pool') == 1 and "stablehlo.while" in text
    small = batch(3, 5)
    text = jax.jit(jax.vmap(step)).trace(*small).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count('prefix = "kda_decode_sm90_pool') == 1 and "stablehlo.while" not in text
    jax.jit(jax.vmap(step)).trace(*batch(0, 5)).lower(lowering_platforms=("cuda",))
    reason = sm90.decode_unavailable_reason(bf16, 2**24, (4, 1, 128, 128))
    assert reason is not None and "'v'" in reason and "split the call" in reason
    assert sm90.decode_unavailable_reason(bf16, 2**23, (4, 1, 128, 128)) is None
