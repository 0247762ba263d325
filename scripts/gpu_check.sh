#!/usr/bin/env bash
# The GPU check (`mcar bench gpu`, mcar/bench/gpu_check.py), one stage per process under a timeout, resumable:
# each stage writes <stage>.json (with the fingerprint of what it measured: model, overrides, tiny or not, torch,
# device) into the output folder, then `merge` joins them into bench_gpu.json and bench_gpu.md (targets included).
# Run it again after a failure, a timeout or a kill: stages done by the same run are skipped; a stage measured by
# another run is moved to <stage>.json.stale and runs again.
#
#   bash scripts/gpu_check.sh                      # 700m, paper setting (16-frame clips, bf16, act. ckpt, compile)
#   bash scripts/gpu_check.sh --tiny               # every stage at tiny size on CPU in about a minute (CI runs it)
#   bash scripts/gpu_check.sh --out DIR --timeout 420 --budget 1800 model=300m   # extra args: Hydra overrides
#
# --out: outputs/gpu_check by default, outputs/gpu_check_tiny with --tiny (a tiny run never stands in for a real one).
# --timeout: seconds per stage (480). --budget SECONDS (or GPU_CHECK_BUDGET): a stage whose estimate
# (scripts/gpu_estimates.yaml) does not fit the time left since the script started, less merge's, is skipped for a
# later run; a started stage's timeout is cut to the time left. --stages "A B": only these stages, in this order.
# --wheels DIR installs DIR/*.whl (bash scripts/wheelhouse.sh DIR builds them) into .site and puts it on PYTHONPATH:
# a GPU machine with torch and lightning and no package index then runs it.
# Always data=synthetic logger=csv: no wandb, av, diffusers or crafter is imported. PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
out=""; tiny=0; wheels=""; limit=480; budget=${GPU_CHECK_BUDGET:-}; only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) tiny=1; shift ;;
    --out) out=$2; shift 2 ;;
    --wheels) wheels=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --stages) only=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
if [ -n "$budget" ] && ! [[ "$budget" =~ ^[0-9]+$ ]]; then
  echo "gpu_check: --budget (or GPU_CHECK_BUDGET) takes whole seconds, not '$budget'"; exit 2
fi
py=${PYTHON:-python3}
if [ -n "$wheels" ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$PWD/.site" "$wheels"/*.whl || exit 1
  export PYTHONPATH="$PWD/.site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$tiny" = 1 ]; then
  out=${out:-outputs/gpu_check_tiny}
  set -- experiment=paper model=tiny data.h=3 data.w=4 data.n_a=2 data.clip_frames=3 data.codebook_size=32 \
    data.action_vocab_size=8 trainer.accelerator=cpu bench.device=cpu bench.gpu.steps=3 bench.gpu.warmup_steps=1 \
    bench.repeats=1 bench.warmup=0 'bench.gpu.sampler_frames=[2,4]' bench.memory.direct=false \
    'bench.gpu.play_sessions=[1,2]' 'bench.gpu.play_more_sessions=[3]' bench.gpu.play_context=3 \
    bench.gpu.play_warmup=1 bench.gpu.play_steps=3 \
    '~bench.gpu.variants.diagd_tma' '~bench.gpu.variants.causal_noac_bf16res' "$@"
else
  out=${out:-outputs/gpu_check}
  set -- experiment=paper model=700m "$@"
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
common=(data=synthetic logger=csv "bench.gpu.dir=$out")
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
bench() {  # bench STAGE: `mcar bench gpu` for one stage, list or merge, with this run's overrides
  "$py" -m mcar.cli bench gpu "bench.gpu.stage=$1" "${common[@]}" "${overrides[@]}" "hydra.run.dir=$out/hydra/$1"
}
overrides=("$@")
# one line per stage: name, state for this run (done, stale or missing), estimate in seconds; then merge's estimate
listing=$(bench list 2>"$out/list.log" | tail -n 1 | "$py" -c '
import json, sys
from omegaconf import OmegaConf
r, e = json.load(sys.stdin), OmegaConf.load("scripts/gpu_estimates.yaml")
for s in r["stages"]:
    print(s, r["state"][s], e.get(s, e.unlisted))
print("merge", "-", e.merge)') || {
  echo "gpu_check: could not list the stages (see $out/list.log):"; tail -n 20 "$out/list.log"; exit 1; }
declare -A state estimate
stages=()
while read -r name st est; do
  estimate[$name]=$est
  [ "$name" = merge ] && continue
  state[$name]=$st
  stages+=("$name")
done <<< "$listing"
for stage in "${stages[@]}"; do  # before any budget or --stages choice: merge never meets another run's stage
  if [ "${state[$stage]}" = stale ]; then
    mv "$out/$stage.json" "$out/$stage.json.stale"
    echo "== $stage: measured by another run (model, overrides, torch or device differ; see its \"fingerprint\"):" \
         "moved to $stage.json.stale, runs again"
  fi
done
selected=("${stages[@]}")
if [ -n "$only" ]; then
  read -r -a selected <<< "$only"
  for stage in "${selected[@]}"; do
    [ -n "${state[$stage]:-}" ] || { echo "gpu_check: --stages: no stage '$stage'; the stages: ${stages[*]}"; exit 2; }
  done
fi
failed=(); deferred=()
for stage in "${selected[@]}"; do
  if [ "${state[$stage]}" = done ]; then
    echo "== $stage: done before, skipped (delete $out/$stage.json to run it again)"
    continue
  fi
  stage_limit=$limit
  if [ -n "$budget" ]; then
    left=$((budget - SECONDS - estimate[merge]))
    if [ "${estimate[$stage]}" -gt "$left" ]; then
      echo "== $stage: skipped for budget (estimate ${estimate[$stage]}s, ${left}s left of --budget ${budget}s" \
           "after merge's ${estimate[merge]}s)"
      deferred+=("$stage")
      continue
    fi
    [ "$left" -lt "$stage_limit" ] && stage_limit=$left
    [ "$stage_limit" -lt 1 ] && stage_limit=1  # timeout 0 would mean no limit
  fi
  echo "== $stage (at most ${stage_limit}s; log: $out/$stage.log)"
  t0=$SECONDS
  timeout --kill-after=30 "$stage_limit" "$py" -m mcar.cli bench gpu "bench.gpu.stage=$stage" "${common[@]}" \
    "${overrides[@]}" "hydra.run.dir=$out/hydra/$stage" >"$out/$stage.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    [ $rc -eq 124 ] && echo "   timed out after ${stage_limit}s" || echo "   failed (exit $rc)"
    tail -n 15 "$out/$stage.log" | sed 's/^/   | /'
    failed+=("$stage")
  else
    echo "   done in $((SECONDS - t0))s: $(tail -n 1 "$out/$stage.log" | cut -c1-200)"
  fi
done
bench merge >"$out/merge.log" 2>&1 || { echo "gpu_check: merge failed (see $out/merge.log)"; tail -n 20 "$out/merge.log"; exit 1; }
cat "$out/bench_gpu.md"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: ${#failed[@]} stage(s) failed or timed out: ${failed[*]} (run the script again to retry them)"
  exit 1
fi
missing=()
for stage in "${stages[@]}"; do [ -f "$out/$stage.json" ] || missing+=("$stage"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpu_check: ${#missing[@]} stage(s) not run yet: ${missing[*]}" \
       "${deferred[*]:+(skipped for budget: ${deferred[*]}) }(run the same command again to run them)"
  exit 0
fi
echo "gpu_check: every stage done; $out/bench_gpu.md"
