#!/usr/bin/env bash
# A GPU-machine job (../shared/device/README.md: run after the two-call staging, from the
# repository root), in two parts that each fit one device call:
#   bash benchmarks/jobs/verify_opt_in.sh tests    the sm90 forward-scan variants: those that
#                                                  were opt-in until they ran on a GPU
#                                                  (training_forward's fuse_outputs,
#                                                  outputs_warpgroup and scan_plain_addend; the
#                                                  defaults since, H100 2026-12-06), the
#                                                  in-kernel input preparation of the chunk
#                                                  core and of the gate-bound forward's PREP
#                                                  and prefill's route to them
#                                                  (IN_KERNEL_PREP), the
#                                                  one still opt-in (outputs_images),
#                                                  against the kernels without them and
#                                                  the float64 oracle
#   bash benchmarks/jobs/verify_opt_in.sh measure  their kernel times beside the default's, and
#                                                  the host cost of a jitted call
#   bash benchmarks/jobs/verify_opt_in.sh all      both in one call (for a session short of
#                                                  device time): the tests, then as much of the
#                                                  measurement as fits (fewer variants and shapes)
#   bash benchmarks/jobs/verify_opt_in.sh prep-cost  prefill on raw inputs with the preparation
#                                                  in the kernels and in XLA, both gates
#                                                  (benchmarks/prep_cost.py; measure runs it too)
#   bash benchmarks/jobs/verify_opt_in.sh quick    about a minute, for a session that gets few
#                                                  GPU minutes: the phase tables of the
#                                                  chunk core (forward-alone, training) and
#                                                  of the fused decayed and tokens'
#                                                  backward on three shapes, and its
#                                                  GPU test
# Logs under $OUT. Each step has its own time limit, so a hang (a wrong barrier) ends its step,
# not the call.
set -u
source .device/env.sh
# the kernels compiled ahead without a GPU (benchmarks/jobs/prefill_kernel_cache.py), if carried
[ -d .device/kc ] && export JAX_KDA_CACHE_DIR="$PWD/.device/kc"
out="${OUT:-/tmp/out}"
mkdir -p "$out"
mode="${1:-tests}"
# every step ends inside the call: its own limit, or what is left of ${DEADLINE_S:-570} s
end=$((SECONDS + ${DEADLINE_S:-570}))
limit() {
  local left=$((end - SECONDS - 5))
  ((left < 1)) && left=1
  ((left < $1)) && echo "$left" || echo "$1"
}
t=tests/test_sm90_backward_gpu.py
g=tests/test_sm90_gpu.py
if [ "$mode" = quick ]; then
  for variant in "" --residuals; do
    timeout "$(limit 45)" python3 -m benchmarks.chunk_core_phases $variant \
      >> "$out/chunk-core-phases.log" 2>&1
    echo "chunk core phases $variant rc=$?"
  done
  cat "$out/chunk-core-phases.log"
  # the training backward's largest kernel, the fused decayed and tokens' backward
  timeout "$(limit 60)" python3 -m pytest -q -s -m gpu --maxfail=5 \
    "$t::test_decayed_tokens_bwd_kernel_equals_the_two_kernels" \
    > "$out/tests-decayed-variants.log" 2>&1
  echo "decayed backward variant tests rc=$?"; tail -2 "$out/tests-decayed-variants.log"
  timeout "$(limit 60)" python3 -m benchmarks.decayed_bwd_phases \
    > "$out/decayed-bwd-phases.log" 2>&1
  echo "decayed backward phases rc=$?"
  cat "$out/decayed-bwd-phases.log"
fi
if [ "$mode" = tests ] || [ "$mode" = all ]; then
  # the kernels against the verified ones, bit for bit where the arithmetic is the same
  timeout "$(limit 240)" python3 -m pytest -q -s -m gpu --maxfail=20 \
    "$t::test_forward_scan_on_the_plain_bf16_addend_equals_the_sliced_one" \
    "$t::test_state_scan_with_outputs_equals_the_scan_and_the_outputs_kernel" \
    "$t::test_chunk_core_images_and_the_scan_on_them_equal_the_plain_ones" \
    "$t::test_chunk_core_prepares_raw_inputs_as_the_xla_preparation" \
    "$g::test_gate_bound_forward_prepares_raw_inputs_as_the_xla_preparation" \
    "$t::test_both_state_scans_kernel_matches_two_xla_scans" \
    "$t::test_scan_kernel_stays_in_bounds_on_bad_boundaries" \
    > "$out/tests-kernels.log" 2>&1
  echo "kernel tests rc=$?"; tail -2 "$out/tests-kernels.log"
  # forward and gradients against the float64 oracle
  timeout "$(limit 260)" python3 -m pytest -q -s -m gpu --maxfail=20 \
    "$t::test_training_forward_scan_switches_match_float64_oracle" \
    "$t::test_prepared_inputs_and_grouped_heads_match_float64" \
    "$g::test_exact_forward_matches_float64_oracle" \
    "$g::test_exact_forward_long_memory_with_custom_scale" \
    > "$out/tests-oracle.log" 2>&1
  echo "oracle tests rc=$?"; tail -2 "$out/tests-oracle.log"
fi
if [ "$mode" = prep-cost ] || [ "$mode" = measure ]; then
  # prefill on raw inputs, the preparation in the kernels against XLA's, both gates
  for bound in "" "--lower-bound -5"; do
    timeout "$(limit 120)" python3 -m benchmarks.prep_cost --calls 100 $bound \
      >> "$out/prep-cost.log" 2>&1
    echo "prep cost $bound rc=$?"
  done
  cat "$out/prep-cost.log"
fi
if [ "$mode" = measure ] || [ "$mode" = all ]; then
  # the default since 2026-12-06 (fo, fow, ua), the one before it, and the opt-in oi; oi
  # changes only a forward that is not differentiated, so the training profile leaves it out
  base="core1+dbwd+x1+s1+dense+tok+bs"
  default="$base+fo+fow+ua"
  variants="$base,$base+ua,$base+fo+ua,$default,$default+oi"
  train_variants="$base,$default"
  shapes="2048x12x1,8192x16x1,8192x24x1,1024x4x1,33x2x3-ragged"
  if [ "$mode" = all ]; then
    variants="$default,$default+oi"
    train_variants="$default"
    shapes="2048x12x1,8192x16x1,1024x4x1,33x2x3-ragged"
  fi
  timeout "$(limit 150)" python3 -m benchmarks.kernel_profile --only "$shapes" --train-variants "$variants" \
    --forward-only > "$out/profile-forward.log" 2>&1
  echo "forward profile rc=$?"
  timeout "$(limit 200)" python3 -m benchmarks.kernel_profile --only "$shapes" \
    --train-variants "$train_variants" > "$out/profile-train.log" 2>&1
  echo "training profile rc=$?"
  # the harness's chained loop against the call alone (2026-12-06, H100: 124.3 us a call in
  # the harness against a 100.7 us span alone at 2048x12x1): idle gaps or slower kernels
  for exact in --exact ""; do
    timeout "$(limit 60)" python3 -m benchmarks.kernel_profile --only 2048x12x1 --chained 100 \
      $exact >> "$out/profile-chained.log" 2>&1
  done
  grep -E "span" "$out/profile-forward.log" "$out/profile-train.log" "$out/profile-chained.log"
  # where a chunk-core CTA's time goes, phase by phase (its own clocks)
  for variant in "" --residuals; do  # forward-alone, training
    timeout "$(limit 60)" python3 -m benchmarks.chunk_core_phases $variant \
      >> "$out/chunk-core-phases.log" 2>&1
    echo "chunk core phases $variant rc=$?"
  done
  cat "$out/chunk-core-phases.log"
  # jax_kda's share of a jitted call's host time (SPEC: under 20 us), both forwards
  for exact in "" --exact; do
    timeout "$(limit 90)" python3 -m benchmarks.host_cost --only "2048x12x1,33x2x3-ragged" --calls 100 \
      $exact >> "$out/host-cost.log" 2>&1
  done
  cat "$out/host-cost.log"
fi
