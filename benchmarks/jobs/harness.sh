#!/usr/bin/env bash
# A GPU-machine job (after the two-call staging, carrying .device/peers; from the repository
# root): the harness on SPEC's shapes, FlashKDA's and the edge cases, jax_kda against the peers
# in the same run, one mode per call (forward or train: `bash benchmarks/jobs/harness.sh
# train`). The parts run in the order of what they cost against what they tell: jax_kda's own
# rows first, then the cuDNN engines (in a process of their own: a failed graph capture there
# can poison the next one's CUDA state), then jla, then fla (Triton autotuning, about 100 s a
# head count on its first call: on 2026-12-06 it took the jax part's whole limit after one
# shape). Every part ends inside what is left of the call (DEADLINE_S, default 570 s;
# --stop-after), and a second call with the same arguments on the same warm machine resumes
# where the first stopped. Results under $OUT/MODE/.
set -u
source .device/env.sh
# the kernels compiled ahead without a GPU (benchmarks/jobs/prefill_kernel_cache.py), if carried
[ -d .device/kc ] && export JAX_KDA_CACHE_DIR="$PWD/.device/kc"
out="${OUT:-/tmp/out}"
mode="${1:-forward}"
train=""
[ "$mode" = train ] && train="--train"
mkdir -p "$out/$mode"
json="$out/$mode/$mode.json"
[ -f "/tmp/harness-$mode.json" ] && cp "/tmp/harness-$mode.json" "$json"
end=$((SECONDS + ${DEADLINE_S:-570}))
shapes="spec,flashkda,edge"
for part in "jax_kda/sm90,sm90_exact" cudnn jla fla; do
  left=$((end - SECONDS))
  if ((left < 60)); then
    echo "$part: skipped, ${left} s left (a second call resumes)"
    continue
  fi
  resume=""
  [ -f "$json" ] && resume="--resume"
  # the part stops starting rows 45 s before the call's end; a row under way finishes
  timeout "$((left - 5))" python3 -m benchmarks.run $train $resume --stop-after "$((left - 45))" \
    --output "$json" --only "$shapes,$part" > "$out/$mode/${part%%/*}.log" 2>&1
  echo "$part rc=$?"
  [ -f "$json" ] && cp "$json" "/tmp/harness-$mode.json"  # for a resumed call
done
[ -f "${json%.json}.md" ] && tail -40 "${json%.json}.md"
