"""`mcar bench sampler|train|memory|gpu|data|tokenizer|play|serve [hydra overrides]`: speed and memory on random weights
(conf/bench.yaml); play: a trained checkpoint's game (ckpt=...).

sampler, train: mcar/bench/speed.py; memory, gpu (the staged check a GPU machine runs first): mcar/bench/gpu_check.py;
data (the input pipeline at VPT scale): mcar/bench/data_speed.py; tokenizer (VQ-encoding cost):
mcar/bench/tokenize_speed.py; play (what a player sees, steps per k, many games, held-out rollouts):
mcar/bench/play_speed.py; serve (simulated players on the page itself): mcar/bench/serve.py.
The result is one JSON object written to bench.out (the run's output dir); play and serve print a table (and the
JSON's path), the other modes the JSON line.
"""
from __future__ import annotations

import json

from omegaconf import DictConfig

from mcar.atomic import write_atomic
from mcar.bench.data_speed import run_data
from mcar.bench.gpu_check import run_gpu, run_memory
from mcar.bench.play_speed import play_table, run_play
from mcar.bench.serve import run_serve, serve_table
from mcar.bench.speed import run_sampler, run_train
from mcar.bench.tokenize_speed import run_tokenizer
from mcar.hydra_app import hydra_tool

MODES = {"sampler": run_sampler, "train": run_train, "memory": run_memory, "gpu": run_gpu, "data": run_data,
         "tokenizer": run_tokenizer, "play": run_play, "serve": run_serve}


TABLES = {"play": play_table, "serve": serve_table}


def mode_words(argv: list[str]) -> list[str]:
    """`sampler|train|...|serve` (a mode of MODES) as the first word -> the bench.mode override Hydra understands."""
    return [f"bench.mode={argv[0]}", *argv[1:]] if argv and argv[0] in MODES else argv


@hydra_tool("bench", words=mode_words)
def main(cfg: DictConfig) -> None:
    if cfg.bench.mode not in MODES:
        raise ValueError(f"bench.mode={cfg.bench.mode!r}: run `mcar bench {'|'.join(MODES)} ...`")
    result = MODES[cfg.bench.mode](cfg)
    line = json.dumps(result)
    write_atomic(cfg.bench.out, line + "\n")
    if cfg.bench.mode in TABLES:  # a person reads the table; the JSON stays in its file
        print(f"{TABLES[cfg.bench.mode](result)}\n\nJSON: {cfg.bench.out}", flush=True)
    else:
        print(line, flush=True)
