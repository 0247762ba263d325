#!/usr/bin/env bash
# 1 vs 2 torch threads for play, generate, evaluate (the shipped model) and training (tiny, synthetic): one line per
# thread count. BENCHMARKS.md ("Threads") ran it idle and beside 1 or 2 `python3 -c "while True: pass"` processes.
#   bash scripts/bench_threads.sh [label]
set -euo pipefail
cd "$(dirname "$0")/.."
S=checkpoints/shipped/crafter_tiles_diagd
OUT=$(mktemp -d)
label=${1:-here}
for t in 1 2; do
  mcar bench play ckpt=$S bench.play.steps=10 bench.repeats=2 'bench.play.ks=[2]' bench.threads=$t \
       bench.play.player_steps=0 bench.play.sessions=null hydra.run.dir=$OUT/play > /dev/null 2>&1
  play=$(python -c "import json; print(json.load(open('$OUT/play/bench_play.json'))['steps']['ks']['2']['frames_per_s'])")
  gen=$(mcar generate ckpt=$S prompt=3 threads=$t hydra.run.dir=$OUT/gen 2>&1 | grep -o "passes, [0-9.]*s" | tail -1)
  mcar evaluate ckpt=$S logger=csv n_clips=8 videos=0 threads=$t hydra.run.dir=$OUT/eval > /dev/null 2>&1
  fps=$(python -c "import json; print(round(json.load(open('$OUT/eval/results.json'))['rows'][0]['fps'], 2))")
  train=$(mcar bench train model=tiny data=synthetic bench.threads=$t hydra.run.dir=$OUT/train 2>/dev/null \
          | tail -1 | python -c "import sys, json; print(json.loads(sys.stdin.read())['ms_per_step'])")
  echo "$label threads=$t play_frames_per_s=$play generate_sampling=\"${gen#passes, }\" evaluate_fps=$fps train_ms_per_step=$train"
done
rm -rf "$OUT"
