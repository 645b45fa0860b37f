"""Compile, here and without a GPU, the kernels the GPU-machine jobs will run, into a kernel cache
to carry there, so that no device time goes to compiling them.

    CUTE_DSL_ARCH=sm_90a JAX_KDA_CACHE_DIR=.device/kc python -m benchmarks.jobs.prefill_kernel_cache

then carry `.device/kc` (the jobs use it when it is there). It lowers prefill and its gradient for
CUDA on the tests' and benchmarks' head counts, with and without a gate bound, in either
residuals mode (the lowering exports every kernel the call takes), and exports the opt-in scan
variants directly: about 8 to 12 minutes on 2 cores, about 18 MB. The cache is keyed by the
kernel sources and the DSL version, so a changed kernel is compiled again there, never taken
stale from here.
"""

from __future__ import annotations

import itertools
import os
import time

HEADS = (1, 2, 3, 4, 8, 10, 12, 16, 24, 32)
"""Head counts of the GPU tests and of the benchmark shapes (the gate-bound forward kernel is
compiled per head count)."""


def _main():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import jax
    import jax.numpy as jnp

    import jax_kda
    from jax_kda import sm90
    from jax_kda.constants import default_scale
    from jax_kda.oracle import production_inputs
    from jax_kda.sm90.kernels.input_prep import InputPrep
    from jax_kda.sm90.kernels.layout import SCAN_TC_V_SLICES

    os.environ[sm90.ASSUME_SM90_ENV] = "1"
    os.environ.setdefault(sm90.SM_COUNT_ENV, "132")
    start = time.perf_counter()
    calls = itertools.product(HEADS, (-5.0, None), (None, 0.3), ("saved", "recompute"))
    for heads, bound, scale, residuals in calls:
        x = production_inputs([256, 0, 100], heads, seed=0)

        def call(q, k, v, g, beta, cu, state, bound=bound, scale=scale, residuals=residuals):
            return jax_kda.prefill(
                q, k, v, g, beta, cu_seqlens=cu, initial_state=state, scale=scale,
                gate_lower_bound=bound, backend="sm90", residuals=residuals,
            )  # fmt: skip

        def loss(*args, call=call):
            o, final = call(*args)
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

        args = [jnp.asarray(a) for a in x]
        for fn in (call, jax.grad(loss, argnums=(0, 1, 2, 3, 4, 6))):
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    for v_slice, passes in itertools.product(SCAN_TC_V_SLICES, (1, 3)):
        sm90.state_scan_artifact(False, v_slice, True, passes, True)
    for v_slice in SCAN_TC_V_SLICES:
        sm90.state_scans_artifact(v_slice, True)
        # the training path's bf16 chunk states and reverse addend, every width (their GPU test)
        sm90.state_scans_artifact(v_slice, True, True, True)
        sm90.state_scan_artifact(False, v_slice, True, 1, True, True)
        sm90.state_scan_artifact(True, v_slice, True, 1, False, False, True)
        # the reverse scan in prefill's state layout, as state_scan_kernel runs it at one pass
        sm90.state_scan_artifact(True, v_slice, True, 1, False, False, True, True)
        sm90.state_scan_artifact(True, v_slice, True, 1, False, False, False, True)
        sm90.state_scan_outputs_artifact(v_slice, True, True, False, True)
        sm90.state_cotangent_artifact(v_slice, True)
        sm90.backend.reverse_scan_addend_artifact(v_slice)  # FUSE_ADDEND's (its GPU test)
        for states, split in itertools.product((True, False), (False, True)):
            sm90.state_scan_outputs_artifact(v_slice, states, split)
            if split and not states:  # Qg and Aqk as the chunk core's images variant writes
                sm90.state_scan_outputs_artifact(v_slice, states, split, True)
    preps = [InputPrep(qk_l2norm=True), InputPrep(grouped_qk=True)]  # the GPU tests' variants
    for bound, grouped in itertools.product((-5.0, None), (False, True)):
        preps.append(InputPrep(True, True, bound, True, grouped))
    # the gate-bound forward's in-kernel preparation: its GPU test's variants (3 heads, 6 grouped
    # over 3), prefill's safe-gate route in the oracle test (4 over 2) and benchmarks/prep_cost.py
    every = InputPrep(True, True, -5.0, True)
    gate_bound = [(3, every), (3, InputPrep(qk_l2norm=True))]
    gate_bound += [(heads, InputPrep(True, True, -5.0, True, True)) for heads in (4, 6)]
    gate_bound += [(heads, every) for heads in (2, 12, 16)]
    for heads, prep in gate_bound:
        sm90.forward_artifact(heads, default_scale(), prep)
    # every combination of the preparations (tests/oracle_gradients.py, PREPARATIONS): the
    # gate-bound forward's at 2 q heads, the chunk core's with either gate form
    for norm, gate, logits, grouped in itertools.product((False, True), repeat=4):
        if not (norm or gate or logits or grouped):
            continue
        for bound in (-5.0, None) if gate else (None,):
            prep = InputPrep(norm, gate, bound, logits, grouped)
            sm90.chunk_operands_artifact(0.3, 1, False, False, prep)
        prep = InputPrep(norm, gate, -5.0 if gate else None, logits, grouped)
        sm90.forward_artifact(4 if grouped else 2, default_scale(), prep)
    sm90.dense_bwd_artifact(True)
    sm90.chunk_outputs_artifact(True)
    # benchmarks/decayed_bwd_phases.py, and the fused backward's GPU test
    sm90.decayed_tokens_bwd_artifact(default_scale(), True)
    sm90.decayed_tokens_bwd_artifact(0.3)
    for residuals in (False, True):  # benchmarks/chunk_core_phases.py's diagnostic
        sm90.chunk_operands_artifact(default_scale(), 1, residuals, stamps=True)
    for scale in (0.3, default_scale()):
        sm90.chunk_operands_artifact(scale, 1, False)
        sm90.chunk_operands_artifact(scale, 1, False, True)
        for prep in preps:
            sm90.chunk_operands_artifact(scale, 1, False, False, prep)
    print(f"kernel cache filled in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    _main()
