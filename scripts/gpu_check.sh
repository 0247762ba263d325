#!/usr/bin/env bash
# The staged GPU check (mcar/eval/gpu_check.py): each stage in its own process under a timeout, writing <stage>.json into
# the output folder; a stage whose JSON is already there is skipped (run again after a kill or a timeout: it
# resumes), then `merge` joins what is there into bench_gpu.json and bench_gpu.md (targets included).
#
#   bash scripts/gpu_check.sh                      # 700m, paper setting (16-frame clips, bf16, act. ckpt, compile)
#   bash scripts/gpu_check.sh --tiny               # every stage at tiny size on CPU in a few minutes (CI runs it)
#   bash scripts/gpu_check.sh --out DIR --timeout 420 --wheels .whl model=300m   # extra args: Hydra overrides
#
# --wheels DIR installs DIR/*.whl (bash ../shared/wheelhouse.sh DIR builds them: hydra-core, omegaconf, antlr4,
# diffusers) into .site and puts it on PYTHONPATH: a GPU machine with only torch and lightning then runs it.
# Always data=synthetic logger=csv: no wandb, av, diffusers or crafter is imported. PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
out=outputs/gpu_check; tiny=0; wheels=""; limit=480
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) tiny=1; shift ;;
    --out) out=$2; shift 2 ;;
    --wheels) wheels=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
py=${PYTHON:-python3}
if [ -n "$wheels" ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$PWD/.site" "$wheels"/*.whl || exit 1
  export PYTHONPATH="$PWD/.site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$tiny" = 1 ]; then
  set -- experiment=paper model=tiny data.h=3 data.w=4 data.n_a=2 data.clip_frames=3 data.codebook_size=32 \
    data.action_vocab_size=8 trainer.accelerator=cpu bench.device=cpu bench.gpu.steps=3 bench.gpu.warmup_steps=1 \
    bench.repeats=1 bench.warmup=0 'bench.gpu.sampler_frames=[2,4]' bench.memory.direct=false "$@"
else
  set -- experiment=paper model=700m "$@"
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
common=(data=synthetic logger=csv "bench.gpu.dir=$out")
export PYTHONUNBUFFERED=1
list=$("$py" -m mcar.bench gpu bench.gpu.stage=list "${common[@]}" "$@" "hydra.run.dir=$out/hydra/list" 2>"$out/list.log" \
       | tail -n 1)
stages=$(printf '%s' "$list" | "$py" -c 'import json, sys; print(" ".join(json.load(sys.stdin)["stages"]))') || {
  echo "gpu_check: could not list the stages (see $out/list.log):"; tail -n 20 "$out/list.log"; exit 1; }
failed=()
for stage in $stages; do
  if [ -f "$out/$stage.json" ]; then
    echo "== $stage: done before, skipped (delete $out/$stage.json to run it again)"
    continue
  fi
  echo "== $stage (at most ${limit}s; log: $out/$stage.log)"
  t0=$SECONDS
  timeout --kill-after=30 "$limit" "$py" -m mcar.bench gpu "bench.gpu.stage=$stage" "${common[@]}" "$@" \
    "hydra.run.dir=$out/hydra/$stage" >"$out/$stage.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    [ $rc -eq 124 ] && echo "   timed out after ${limit}s" || echo "   failed (exit $rc)"
    tail -n 15 "$out/$stage.log" | sed 's/^/   | /'
    failed+=("$stage")
  else
    echo "   done in $((SECONDS - t0))s: $(tail -n 1 "$out/$stage.log" | cut -c1-200)"
  fi
done
"$py" -m mcar.bench gpu bench.gpu.stage=merge "${common[@]}" "$@" "hydra.run.dir=$out/hydra/merge" >"$out/merge.log" 2>&1 \
  || { echo "gpu_check: merge failed (see $out/merge.log)"; tail -n 20 "$out/merge.log"; exit 1; }
cat "$out/bench_gpu.md"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: ${#failed[@]} stage(s) failed or timed out: ${failed[*]} (run the script again to retry them)"
  exit 1
fi
echo "gpu_check: every stage done; $out/bench_gpu.md"
