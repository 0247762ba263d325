"""Episodes on disk: <name>.mp4 + <name>.jsonl (one record per frame). Reading that tolerates damage.

`read_episode_actions` parses a jsonl into per-frame action token ids and a keep mask
(`mcar.tokenizer.video.FrameStream` streams the mp4's frames and remembers why it stopped). Problems become notes
(warnings naming the file), not exceptions, unless nothing is left: `EpisodeError`.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mcar.data.vpt_actions import parse_vpt
from mcar.tokenizer.actions import CRAFTER_ACTIONS, action_space


class EpisodeError(Exception):
    """An episode that cannot be used at all; the message is the reason."""


def episode_files(folder: str | Path) -> list[Path]:
    """Every finished <name>.mp4 in `folder` (none when it does not exist), sorted by name."""
    return [f for f in sorted(Path(folder).glob("*.mp4")) if ".part" not in f.name]


def list_episodes(folder: str | Path) -> list[tuple[str, Path, Path]]:
    """(name, mp4, jsonl) for every <name>.mp4 (its <name>.jsonl may be missing), sorted by name."""
    if not Path(folder).is_dir():
        raise FileNotFoundError(f"episode folder {folder} does not exist")
    return [(mp4.stem, mp4, mp4.with_suffix(".jsonl")) for mp4 in episode_files(folder)]


def read_jsonl(path: Path) -> tuple[list, list[str]]:
    """-> (records, notes). A malformed or truncated line becomes None: it still belongs to its frame."""
    if not path.exists():
        raise EpisodeError(f"missing {path.name}")
    records, bad = [], []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    if lines and lines[-1].strip() == b"":
        lines = lines[:-1]  # the newline after the last record
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            records.append(None)
            bad.append(i + 1)
    notes = [f"{len(bad)} malformed jsonl lines (first: line {bad[0]}), their frames dropped"] if bad else []
    return records, notes


def parse_crafter(records: list):
    """Crafter records {"action": name, ...} -> ({"action": name} or None, keep, notes)."""
    actions, keep, unknown = [], [], set()
    for r in records:
        name = r.get("action") if isinstance(r, dict) else None
        ok = name in CRAFTER_ACTIONS
        if isinstance(r, dict) and not ok:
            unknown.add(str(name))
        actions.append({"action": name} if ok else None)
        keep.append(ok)
    return actions, keep, [f"dropped frames with unknown actions {sorted(unknown)}"] if unknown else []


def read_episode_actions(jsonl: Path, source: str, drop_null: bool = True, drop_gui: bool = True,
                         space: str | None = None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """-> (action ids (R, n_a) int64 (zeros where dropped), keep (R,) bool, notes) for the R records, parsed as
    `source` records and encoded in the action space `space` (None: the source's own; vpt records can also be
    encoded as mineworld ids)."""
    records, notes = read_jsonl(jsonl)
    if source == "vpt":
        actions, keep, more = parse_vpt(records, drop_null, drop_gui)
    elif source == "crafter":
        actions, keep, more = parse_crafter(records)
    else:
        raise ValueError(f"unknown episode source {source!r} (vpt or crafter)")
    encoder = action_space(space or source)
    ids = np.zeros((len(records), encoder.n_a), np.int64)
    for i, a in enumerate(actions):
        if a is not None and keep[i]:
            ids[i] = encoder.encode(a)
    return ids, np.array(keep, bool), notes + more
