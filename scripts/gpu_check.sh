#!/usr/bin/env bash
# The staged GPU check (mcar/bench/gpu_check.py; scripts/gpu_calls.py splits it over short borrowed device calls):
# each stage in its own process under a timeout, writing <stage>.json into
# the output folder, then `merge` joins what is there into bench_gpu.json and bench_gpu.md (targets included). Each
# stage JSON records the fingerprint of what it measured (model, overrides, tiny or not, torch, device): a stage done
# by the same run is skipped (run again after a kill or a timeout: it resumes); one measured by another run is moved
# to <stage>.json.stale and runs again; merge refuses stages of different fingerprints. Each stage loads the inductor
# artifacts that earlier stages saved in compile_cache.zip (in the output folder) and adds its own at its end, a
# timeout's included: a stage redone, even on a fresh machine handed that file, compiles from cache.
#
#   bash scripts/gpu_check.sh                      # 700m, paper setting (16-frame clips, bf16, act. ckpt, compile)
#   bash scripts/gpu_check.sh --plan --left 900    # the device calls the stages not done need, in sittings
#   bash scripts/gpu_check.sh --tiny               # every stage at tiny size on CPU in about a minute (CI runs it)
#   bash scripts/gpu_check.sh --out DIR --timeout 420 --wheels .whl model=300m   # extra args: Hydra overrides
#
# --out: outputs/gpu_check by default, outputs/gpu_check_tiny with --tiny (a tiny run never stands in for a real one).
# --timeout: seconds per stage (480). --budget SECONDS (or GPU_CHECK_BUDGET): a stage whose estimate
# (scripts/gpu_estimates.yaml: start-up + graphs compiled x compile_s + work) does not fit the time
# left since the script started, less merge's estimate, is not started: "skipped for budget", for a later call; a
# started stage's timeout is cut to the time left. --plan: print, running nothing, the calls of at most --budget
# seconds (540 unless given) that the stages not done need (all of them, whatever --stages says), packed into
# sittings of device time: the first of --left seconds (what the device tool's status calls budget_left_s; a whole
# sitting, 900, unless given), each with its machine start (gpu_estimates.yaml's `sitting`); each call's --budget,
# stages and estimated seconds, and the total.
# --stages "A B": only these stages, in this order. --copy-to DIR: on exit (even a failed one), DIR gets
# gpu_check.tgz (the JSONs, logs and bench_gpu.md in one file: the lent machine returns at most 8 files), bench_gpu.md
# and compile_cache.zip.
# --wheels DIR installs DIR/*.whl (bash scripts/wheelhouse.sh DIR builds them: hydra-core, omegaconf, antlr4,
# diffusers) into .site and puts it on PYTHONPATH: a GPU machine with only torch and lightning then runs it.
# Always data=synthetic logger=csv: no wandb, av, diffusers or crafter is imported. PYTHON picks the interpreter.
#
# On the lent GPU machine (commands of at most 10 minutes, ~15 minutes of device time a sitting with the machine's
# start, only files under $OUT come back: at most 8, of 16 MiB each), the 700m stages take ~35 minutes of upper
# estimates: more than one sitting. The stages the goals are read from run first (`first` in
# scripts/gpu_estimates.yaml: train causal, train DiagD, sampler DiagD at 16 frames, play at 1 and 16 sessions):
# one sitting of 15 minutes holds them (--plan --left 900: a call of 540 s, then one of 260).
# Each call is one command (carry .whl; `--plan --left <status's budget_left_s>` prints which stages go in which
# call and each call's --budget: a sitting's last call gets what the sitting has left, not 540):
#
#   bash scripts/gpu_check.sh --wheels .whl --budget 540 --copy-to "$OUT/gpu_check"
#
# Each call runs, in order, the stages not done that fit its --budget, ends within ~30 s of it (a stage's kill grace)
# and returns them under gpu_check/. Repeat it until it prints "every stage done". A machine still warm (the next
# call within its 30 s) keeps outputs/gpu_check and inductor's own cache; before a call on a fresh one, carry back
# what the last call returned (here, in the repo root), and add outputs/gpu_check to carry:
#
#   mkdir -p outputs/gpu_check && tar -xzf <files_at>/gpu_check/gpu_check.tgz -C outputs/gpu_check &&
#     cp <files_at>/gpu_check/compile_cache.zip outputs/gpu_check/
#
set -uo pipefail
cd "$(dirname "$0")/.."
out=""; tiny=0; wheels=""; limit=480; budget=${GPU_CHECK_BUDGET:-}; left=""; only=""; copy_to=""; plan=0
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) tiny=1; shift ;;
    --out) out=$2; shift 2 ;;
    --wheels) wheels=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --left) left=$2; shift 2 ;;
    --stages) only=$2; shift 2 ;;
    --copy-to) copy_to=$2; shift 2 ;;
    --plan) plan=1; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
if [ -n "$budget" ] && ! [[ "$budget" =~ ^[0-9]+$ ]]; then
  echo "gpu_check: --budget (or GPU_CHECK_BUDGET) takes whole seconds, not '$budget'"; exit 2
fi
if [ -n "$left" ] && ! [[ "$left" =~ ^[0-9]+$ ]]; then
  echo "gpu_check: --left takes whole seconds (the device tool's budget_left_s), not '$left'"; exit 2
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
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # scripts/gpu_calls.py imports mcar from here
if [ "$plan" = 1 ]; then
  "$py" scripts/gpu_calls.py plan --budget "${budget:-540}" ${left:+--left "$left"} "${common[@]}" "$@" \
    2>"$out/plan.log" | tail -n 1 \
    | "$py" -c 'import json, sys; print(json.load(sys.stdin)["text"])' \
    || { echo "gpu_check: could not plan the calls (see $out/plan.log):"; tail -n 20 "$out/plan.log"; exit 1; }
  exit 0
fi
copy_back() {  # one archive, not a file each: the lent machine returns at most 8 files, of 16 MiB each
  (cd "$out" && tar -czf "$copy_to/gpu_check.tgz" -- $(ls -- *.json *.json.stale *.log bench_gpu.md 2>/dev/null) \
    2>/dev/null)
  cp "$out"/bench_gpu.md "$out/compile_cache.zip" "$copy_to"/ 2>/dev/null
  local mib=$(( $(stat -c %s "$copy_to/compile_cache.zip" 2>/dev/null || echo 0) / 1048576 ))
  [ "$mib" -ge 16 ] && echo "gpu_check: compile_cache.zip is ${mib} MiB: over the lent machine's 16 MiB a file," \
    "it will not come back (the next call compiles cold)"
  return 0
}
if [ -n "$copy_to" ]; then
  mkdir -p "$copy_to"
  copy_to=$(cd "$copy_to" && pwd)
  trap copy_back EXIT
fi
list=$("$py" scripts/gpu_calls.py list "${common[@]}" "$@" 2>"$out/list.log" | tail -n 1)
# one line per stage: name, state for this run (done, stale or missing), estimate in seconds; then merge's estimate
plan=$(printf '%s' "$list" | "$py" -c '
import json, sys
r = json.load(sys.stdin)
for s in r["stages"]:
    print(s, r["state"][s], r["estimate_s"][s])
print("merge", "-", r["estimate_s"]["merge"])') || {
  echo "gpu_check: could not list the stages (see $out/list.log):"; tail -n 20 "$out/list.log"; exit 1; }
declare -A state estimate
stages=()
while read -r name st est; do
  estimate[$name]=$est
  [ "$name" = merge ] && continue
  state[$name]=$st
  stages+=("$name")
done <<< "$plan"
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
  timeout --kill-after=30 "$stage_limit" "$py" scripts/gpu_calls.py stage "$stage" "${common[@]}" "$@" \
    >"$out/$stage.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    [ $rc -eq 124 ] && echo "   timed out after ${stage_limit}s" || echo "   failed (exit $rc)"
    tail -n 15 "$out/$stage.log" | sed 's/^/   | /'
    failed+=("$stage")
  else
    echo "   done in $((SECONDS - t0))s: $(tail -n 1 "$out/$stage.log" | cut -c1-200)"
  fi
done
"$py" -m mcar.cli bench gpu bench.gpu.stage=merge "${common[@]}" "$@" "hydra.run.dir=$out/hydra/merge" >"$out/merge.log" 2>&1 \
  || { echo "gpu_check: merge failed (see $out/merge.log)"; tail -n 20 "$out/merge.log"; exit 1; }
cat "$out/bench_gpu.md"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: ${#failed[@]} stage(s) failed or timed out: ${failed[*]} (run the script again to retry them)"
  exit 1
fi
missing=()
for stage in "${stages[@]}"; do [ -f "$out/$stage.json" ] || missing+=("$stage"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpu_check: ${#missing[@]} stage(s) not run yet: ${missing[*]}" \
       "${deferred[*]:+(skipped for budget: ${deferred[*]}) }(run the same command again, e.g. in the next call)"
  exit 0
fi
echo "gpu_check: every stage done; $out/bench_gpu.md"
