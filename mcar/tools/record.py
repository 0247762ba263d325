"""`mcar record env=<Gymnasium id> episodes=N frames=M out=DIR [policy=random|sticky|<module:factory>]`
(conf/record.yaml): play a Gymnasium game that renders pixels and write a recordings folder that
`python train.py data=recordings data.root=DIR` trains on: <name>.mp4 + <name>.jsonl (one action record per frame:
the action taken at that frame) per episode and actions.yaml, the schema of the game's action space
(mcar.data.gym_env). Episodes already written are kept, so a stopped run resumes; each is written whole or not at
all (its jsonl, then its mp4, each renamed into place)."""
from __future__ import annotations

from mcar.data.gym_env import record_folder
from mcar.hydra_app import compose_tool


def main(argv: list[str] | None = None) -> dict:
    c = compose_tool("record", argv)
    if int(c.episodes) < 1 or int(c.frames) < 2:
        raise SystemExit(f"episodes={c.episodes}, frames={c.frames}: at least 1 episode of 2 frames")
    return record_folder(str(c.env), c.out, int(c.episodes), int(c.frames), str(c.policy), float(c.hold),
                         int(c.seed), dict(c.make or {}), bool(c.lossless))
