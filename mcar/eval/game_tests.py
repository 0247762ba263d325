"""`mcar gametest env=<Gymnasium id> ckpt=...`: the world test any Gymnasium game takes (conf/gametest.yaml).

Fresh games (seeds from `seed_base`, disjoint from the seeds the checkpoint's recordings were made with: checked)
are played by each of `policies` (mcar.data.gym_env's random and sticky, or `package.module:factory`), each named
in the output, after `warmup` of its own steps (a game's first frame can be unlike the rest); from that frame and
every action the model generates the rest of the rollout on each of its windows, scored against the real frames
beside "nothing moves" (copy_last), with 95% bootstrap intervals over games and the model's margin over copy_last
paired game by game (mcar.eval.world_tests.rollout_test).
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from mcar.atomic import write_atomic, write_json
from mcar.core.devices import set_threads
from mcar.data.gym_env import GymGame, make_policy
from mcar.eval.world_tests import ModelRows, Tokens, baseline_margins, ci_cell, rollout_test, write_curves
from mcar.sampling.world_model import WorldModel
from mcar.tokenizer.pictures import data_action_space
from mcar.tokenizer.vq_model import frame_size

log = logging.getLogger("mcar.gametest")


def recorded_seeds(data: DictConfig) -> range:
    """The game seeds a checkpoint's recordings were made with (data.record: seed .. seed + episodes - 1)."""
    rec = data.get("record") or {}
    first = int(rec.get("seed", 0))
    return range(first, first + int(rec.get("episodes", 0)))


def check_seeds(cfg: DictConfig) -> range:
    """The seeds a run may use (20 per start and 20 more: worlds that end early are skipped) -> that range; a
    ValueError when one is a seed of the training recordings."""
    used = range(int(cfg.seed_base), int(cfg.seed_base) + 20 * int(cfg.starts) + 20)
    trained = recorded_seeds(cfg.data)
    overlap = range(max(used.start, trained.start), min(used.stop, trained.stop))
    if len(overlap):
        raise ValueError(f"seed_base={cfg.seed_base}: games {overlap.start}..{overlap.stop - 1} are seeds of the "
                         f"checkpoint's recordings (data.record seeds {trained.start}..{trained.stop - 1}); "
                         f"a test plays games no training saw: a seed_base past {trained.stop - 1}")
    return used


class WarmedUp:
    """A game under the environment protocol whose reset plays `steps` actions of `policy` first: a game's first
    frame (ALE's, before play starts) can look unlike every later one, so a rollout starts from a frame of play."""

    def __init__(self, game, steps: int, policy):
        self.game, self.steps, self.policy = game, int(steps), policy

    def reset(self, seed: int):
        frame = self.game.reset(seed)
        for _ in range(self.steps):
            frame, _ = self.game.step(self.policy(frame))
        return frame

    def step(self, action: int):
        return self.game.step(action)


def check_same_actions(game: GymGame, wm: WorldModel, env: str) -> None:
    """The game's action schema is the one the checkpoint was trained on, or a ValueError saying so."""
    own = data_action_space(wm.cfg.data)  # a schema mapping for recordings, a name (or None) for other data
    if not isinstance(own, dict) or own.get("actions") != game.schema()["actions"]:
        raise ValueError(f"env={env}: its action schema is not the one ckpt={wm.cfg.ckpt} was trained on (data."
                         f"actions): test a checkpoint on the game (and make=) its recordings were made with")


def policy_report(name: str, scores: dict, seed: int) -> dict:
    margins = baseline_margins(scores, seed, keys=("mean", "last"))
    return {"policy": name, "rows": {row: {k: v[k] for k in ("mean", "last", "invented_mean")}
                                     for row, v in scores.items()}, "margins": margins}


def markdown(env: str, reports: list[dict], frames: int) -> str:
    lines = [f"{env}: {frames}-frame rollouts from one real frame, token agreement with the real frames (95% "
             f"bootstrap intervals over games)", "",
             "| policy | row | mean | last step | minus copy_last (mean) | minus copy_last (last) |",
             "|---|---|---|---|---|---|"]
    for r in reports:
        margin = {m["row"]: m for m in r["margins"] if m["baseline"] == "copy_last"}
        for row, v in r["rows"].items():
            m = margin.get(row, {})
            lines.append(f"| {r['policy']} | {row} | {ci_cell(v['mean'])} | {ci_cell(v['last'])} | "
                         f"{ci_cell(m.get('mean'))} | {ci_cell(m.get('last'))} |")
    return "\n".join(lines) + "\n"


def game_tests(cfg: DictConfig) -> dict:
    set_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    check_seeds(cfg)
    wm = WorldModel.from_config(cfg)
    size = frame_size(wm.vq, wm.layout.h, wm.layout.w)
    game = GymGame(str(cfg.env), size=size, **dict(cfg.get("make") or {}))
    if not hasattr(game.space, "n"):
        raise ValueError(f"env={cfg.env}: gametest plays games of one Discrete action (its action space is "
                         f"{type(game.space).__name__})")
    check_same_actions(game, wm, str(cfg.env))
    rows, tokens = ModelRows(wm, cfg.get("windows")), Tokens(wm.vq, wm.layout, wm.codebook_size)
    out = Path(cfg.paths.output_dir)
    reports, curves = [], {}
    for name in cfg.policies:
        chosen = make_policy(str(name), game.space, np.random.default_rng(int(cfg.seed)), float(cfg.hold))
        policy = lambda frame, chosen=chosen: game.data_id(chosen(frame))  # the protocol takes data action ids
        played = WarmedUp(game, int(cfg.warmup), policy)
        scores, per_step = rollout_test(rows, tokens, played, policy, int(cfg.starts), int(cfg.rollout_frames),
                                        int(cfg.seed_base), int(cfg.seed))
        reports.append(policy_report(str(name), scores, int(cfg.seed)))
        curves.update({f"{name} {row}": c for row, c in per_step.items()})
    game.close()
    res = {"env": str(cfg.env), "ckpt": str(cfg.ckpt), "starts": int(cfg.starts), "seed_base": int(cfg.seed_base),
           "rollout_frames": int(cfg.rollout_frames), "policies": reports}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "game_tests.json", res)
    write_curves(curves, out / "rollout_agreement.csv")
    md = markdown(str(cfg.env), reports, int(cfg.rollout_frames))
    write_atomic(out / "game_tests.md", md)
    log.info("%s\nwritten to %s (game_tests.json, rollout_agreement.csv)", md, out)
    return res
