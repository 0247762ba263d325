#!/usr/bin/env bash
# Every compiled sampler step is one graph: run before and after any change to a GPU path (the cached attention,
# split-KV, the buckets, the staged inputs, the sampling rule, compiling.py). For each mode below, the gpu-aot
# tool (its check.sh, kept outside this repository) compiles the step as play and generate run it on a fake H100 and
# runs it for many passes; this script checks that it printed 1 dynamo graph, no graph break, 1 CUDA graph, and
# 0 inputs copied into that graph per replay, and exits 1 when any mode did not (2 when the tool failed).
#
#   bash scripts/graph_check.sh --aot DIR [--python PY] [--layers N] [--only 'NAME ...'] [--out DIR]
#
# --aot: the gpu-aot folder (or $GPU_AOT). --python: a Python with torch 2.11 (CUDA build) and triton 3.6 (or
# $PYTHON). --layers: the model's layers (default 2: the graphs and guards are the same at 20, 30-90 s a mode on 2 CPU
# cores; the launch counts scale with the layers). --only: a subset of the mode names. --out: outputs/graph_check;
# each mode's log is OUT/<name>.log. Prints one row per mode: graphs, passes through the CUDA graph, launches per
# pass, inputs copied per replay, compile seconds, wall seconds, OK or FAIL; the logs name each recompile's failed
# guard and each graph break (TORCH_LOGS=recompiles,graph_breaks unless set).
#
# Modes (700m shapes; kv_splits auto picks 4 at batch 1 and 1 at 4 or more on an H100):
#   generate_diagd        ScheduleSampler.generate, DiagD k=2, 16 frames, batch 1, all 749 passes (split-KV 4)
#   generate_diagd_one    the same with kv_splits=1
#   generate_ntp          NTP, 16 frames, the first 1,400 passes (4 frames of buckets; split-KV 4)
#   rolling_diagd_b1      play's one-player path: a rollout on a 16-frame ring, the whole steady advance (split-KV 4)
#   rolling_diagd_b1_one  the same with kv_splits=1
#   rolling_diagd_b4      4 players (kv_splits 1)
#   rolling_diagd_b4_split  4 players with kv_splits=2 (the batch merged with the heads in split-KV's views)
#   rolling_diagd_b16     16 players (kv_splits 1)
#   rolling_ntp           NTP on a 4-frame ring, the whole steady advance (336 passes), kv_splits=4
#   rolling_ntp_one       the same with kv_splits=1
set -uo pipefail
aot=${GPU_AOT:-}
py=${PYTHON:-python3}
layers=2
only=""
out=outputs/graph_check
while [ $# -gt 0 ]; do
  case $1 in
    --aot) aot=$2; shift 2 ;;
    --python) py=$2; shift 2 ;;
    --layers) layers=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "graph_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -n "$aot" ] && [ -f "$aot/check.sh" ] || { echo "graph_check: --aot DIR (or GPU_AOT) must name the gpu-aot folder, with its check.sh" >&2; exit 2; }
[ -d mcar ] || { echo "graph_check: run from the project root (no ./mcar here)" >&2; exit 2; }

declare -A MODES=(
  [generate_diagd]="STEP=generate PASSES=all"
  [generate_diagd_one]="STEP=generate PASSES=all KV_SPLITS=1"
  [generate_ntp]="SAMPLER=ntp STEP=generate PASSES=1400"
  [rolling_diagd_b1]="STEP=rolling CONTEXT=16 B=1 PASSES=all"
  [rolling_diagd_b1_one]="STEP=rolling CONTEXT=16 B=1 PASSES=all KV_SPLITS=1"
  [rolling_diagd_b4]="STEP=rolling CONTEXT=16 B=4 PASSES=all"
  [rolling_diagd_b4_split]="STEP=rolling CONTEXT=16 B=4 PASSES=all KV_SPLITS=2"
  [rolling_diagd_b16]="STEP=rolling CONTEXT=16 B=16 PASSES=all"
  [rolling_ntp]="SAMPLER=ntp STEP=rolling CONTEXT=4 PASSES=all KV_SPLITS=4"
  [rolling_ntp_one]="SAMPLER=ntp STEP=rolling CONTEXT=4 PASSES=all KV_SPLITS=1"
)
ORDER="generate_diagd generate_diagd_one generate_ntp rolling_diagd_b1 rolling_diagd_b1_one rolling_diagd_b4
rolling_diagd_b4_split rolling_diagd_b16 rolling_ntp rolling_ntp_one"
names=${only:-$ORDER}
for name in $names; do
  [ -n "${MODES[$name]:-}" ] || { echo "graph_check: no mode $name (see --help)" >&2; exit 2; }
done
mkdir -p "$out"
status=0
printf '| mode | graphs | breaks | passes | launches per pass | copied per replay | compile s | wall s | |\n'
printf '| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n'
for name in $names; do
  log=$out/$name.log
  start=$(date +%s)
  # shellcheck disable=SC2086  # the mode's options are words
  TORCH_LOGS=${TORCH_LOGS:-recompiles,graph_breaks} bash "$aot/check.sh" --python "$py" --out "$out/aot" sampler ${MODES[$name]} LAYERS="$layers" >"$log" 2>&1
  rc=$?
  wall=$(( $(date +%s) - start ))
  dynamo=$(grep -m1 '^dynamo: ' "$log")
  graphs=$(sed -n 's/^dynamo: \([0-9]*\) graphs.*/\1/p' <<<"$dynamo")
  breaks=$(grep -o "': [0-9]*[,}]" <<<"${dynamo%%; CUDA graph skips*}" | grep -o '[0-9]*' | awk '{s += $1} END {print s + 0}')
  cuda=$(grep -c '^CUDA graph [0-9]*: ' "$log")
  passes=$(sed -n 's/^CUDA graph [0-9]*: \([0-9]*\) passes.*/\1/p' "$log" | paste -sd+)
  copied=$(sed -n 's/.* \([0-9?]*\) copied into the graph.*/\1/p' "$log" | paste -sd+)
  launches=$(sed -n 's/^launches per pass (each graph.s wrapper): //p' "$log" | sed 's/ ([^)]*)//g; s/; /+/g')
  compile=$(sed -n 's/.* step: compiled in \([0-9]*\) s.*/\1/p' "$log")
  verdict=OK
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 1 ]; then
    verdict="FAIL (check.sh exit $rc: $log)"; status=2
  elif [ "$graphs" != 1 ] || [ "${breaks:-0}" != 0 ] || [ "$cuda" != 1 ] || [ "$copied" != 0 ]; then
    verdict="FAIL ($log)"; [ "$status" -eq 0 ] && status=1
  fi
  printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$name" "${graphs:-?}" "${breaks:-0}" "${passes:-?}" \
    "${launches:-?}" "${copied:-?}" "${compile:-?}" "$wall" "$verdict"
done
[ "$status" -eq 0 ] && echo "every mode: 1 graph, 0 graph breaks, 0 inputs copied per replay" ||
  echo "graph_check: a mode is not one graph without copies (its log says which guard or break)" >&2
exit "$status"
