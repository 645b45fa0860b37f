#!/usr/bin/env bash
# A GPU-machine job (after the two-call staging, carrying .device/peers; from the repository
# root): the harness on SPEC's shapes, FlashKDA's and the edge cases, jax_kda against the peers
# in the same process, one mode per call (forward or train: `bash benchmarks/jobs/harness.sh
# train`). Each part ends inside the call's limit (--stop-after) and a second call with the
# same arguments resumes it. The cuDNN engines run in a process of their own (a failed graph
# capture there can poison the next one's CUDA state). Results under $OUT/MODE/.
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
resume=""
[ -f "$json" ] && resume="--resume"
timeout 330 python3 -m benchmarks.run $train $resume --stop-after 270 --output "$json" \
  --only "spec,flashkda,edge,jax_kda/sm90,sm90_exact,fla,jla" > "$out/$mode/jax.log" 2>&1
echo "jax and triton peers rc=$?"
timeout 220 python3 -m benchmarks.run $train --resume --stop-after 170 --output "$json" \
  --only "spec,flashkda,edge,cudnn" > "$out/$mode/cudnn.log" 2>&1
echo "cudnn rc=$?"
cp "$json" "/tmp/harness-$mode.json"  # for a resumed call on the same warm machine
tail -40 "${json%.json}.md"
