"""`mcar record env=<Gymnasium id> episodes=N frames=M out=DIR [policy=random|sticky|<module:factory>]`
(conf/record.yaml): play a Gymnasium game that renders pixels and write a recordings folder that
`python train.py data=recordings data.root=DIR` trains on: <name>.mp4 + <name>.jsonl (one action record per frame:
the action taken at that frame) per episode and actions.yaml, the schema of the game's action space
(mcar.data.gym_env). Episodes already written are kept, so a stopped run resumes; each is written whole or not at
all (its jsonl, then its mp4, each renamed into place)."""
from __future__ import annotations

import importlib
import json
import time
from pathlib import Path

import numpy as np
import yaml
from tqdm import tqdm

from mcar.data.files import write_atomic
from mcar.data.gym_env import POLICIES, GymGame, StickyPolicy
from mcar.hydra_app import compose_tool
from mcar.tokenizer.video import write_mp4


def make_policy(name: str, space, rng: np.random.Generator, hold: float):
    """policy=random|sticky, or `package.module:factory` (imported because it was named: factory(space, rng))."""
    if name == "sticky":
        return StickyPolicy(space, rng, hold)
    if name in POLICIES:
        return POLICIES[name](space, rng)
    if ":" not in name:
        raise SystemExit(f"policy={name!r}: random, sticky or package.module:factory")
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)(space, rng)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"policy={name}: {e}") from None


def play_episode(game: GymGame, policy, seed: int, frames: int) -> tuple[list[np.ndarray], list[dict]]:
    """Up to `frames` frames from reset(seed), each with the action the policy took at it."""
    frame, shown, records = game.reset(seed), [], []
    for _ in range(frames):
        action = policy(frame)
        shown.append(frame)
        records.append(game.record(action))
        frame, info = game.step(action)
        if info["done"]:
            break
    return shown, records


def record(c) -> dict:
    out = Path(c.out)
    game = GymGame(str(c.env), **dict(c.make or {}))
    schema = game.schema()
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "actions.yaml", yaml.safe_dump(schema, sort_keys=False).encode())
    fps = schema.get("fps") or 15
    codec = dict(codec="libx264rgb", pix_fmt="rgb24", crf=0) if c.lossless else dict(crf=12, pix_fmt="yuv444p")
    written, kept, t0 = 0, 0, time.perf_counter()
    stem = str(c.env).replace("/", "_")
    for i in tqdm(range(int(c.episodes)), desc=f"recording {c.env}", unit="ep"):
        name = f"{stem}_s{int(c.seed) + i:05d}"
        if (out / f"{name}.mp4").exists():
            kept += 1
            continue
        rng = np.random.default_rng(int(c.seed) + i)
        shown, records = play_episode(game, make_policy(str(c.policy), game.space, rng, float(c.hold)),
                                      int(c.seed) + i, int(c.frames))
        write_atomic(out / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode())
        write_mp4(shown, out / f"{name}.mp4", fps, **codec)  # last: a present mp4 is a finished episode
        written += len(shown)
    game.close()
    seconds = time.perf_counter() - t0
    summary = {"out": str(out), "episodes": int(c.episodes), "kept": kept, "frames": written,
               "seconds": round(seconds, 1), "n_a": len(schema["actions"])}
    print(f"{c.env}: {int(c.episodes) - kept} episodes ({written} frames) in {seconds:.1f} s -> {out}"
          f"{f' ({kept} kept from before)' if kept else ''}; train: python train.py data=recordings data.root={out}")
    return summary


def main(argv: list[str] | None = None) -> dict:
    c = compose_tool("record", argv)
    if int(c.episodes) < 1 or int(c.frames) < 2:
        raise SystemExit(f"episodes={c.episodes}, frames={c.frames}: at least 1 episode of 2 frames")
    return record(c)
