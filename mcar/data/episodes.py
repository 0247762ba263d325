"""Episodes on disk: <name>.mp4 + <name>.jsonl (one record per frame). Reading that tolerates damage.

Sources: `recordings` (any game: a folder's actions.yaml declares the schema, mcar.tokenizer.action_schema),
`crafter` (the same reader with Crafter's schema) and `vpt` (VPT's raw records parsed first, then VPT's schema).
`read_episode_actions` parses a jsonl into per-frame action token ids and a keep mask
(`mcar.tokenizer.video.FrameStream` streams the mp4's frames and remembers why it stopped). Problems become notes
(warnings naming the file), not exceptions, unless nothing is left: `EpisodeError`.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mcar.data.vpt_actions import parse_vpt
from mcar.tokenizer.action_schema import RecordError, SchemaError
from mcar.tokenizer.actions import action_space

SOURCES = ("recordings", "crafter", "vpt")
SCHEMA_FILES = ("actions.yaml", "actions.yml", "actions.json")


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


def encode_records(records: list, space) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Records (one per frame; None: a malformed line) -> (ids (R, n_a), keep (R,), notes): a record the schema
    cannot encode is dropped, counted and its first reason named once; clamped axis values counted per field."""
    ids = np.zeros((len(records), space.n_a), np.int64)
    keep = np.zeros(len(records), bool)
    bad, first, clamped = 0, None, {}
    for i, r in enumerate(records):
        if r is None:
            continue  # read_jsonl counted it
        try:
            encoded = space.encode_counted(r)
        except RecordError as e:
            bad, first = bad + 1, first or f"record {i + 1}: {e}"
            continue
        ids[i], keep[i] = encoded.ids, True
        for f in encoded.clamped:
            clamped[f] = clamped.get(f, 0) + 1
    notes = [f"{bad} records the action schema cannot encode, their frames dropped (first: {first})"] if bad else []
    notes += [f"{n} values of {f} outside its range, clamped" for f, n in clamped.items()]
    return ids, keep, notes


def read_episode_actions(jsonl: Path, source: str, drop_null: bool = True, drop_gui: bool = True,
                         space: str | dict | None = None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """-> (action ids (R, n_a) int64 (zeros where dropped), keep (R,) bool, notes) for the R records, parsed as
    `source` records and encoded in the action space `space` (a name or a schema mapping; None: the source's own;
    vpt records can also be encoded as mineworld ids; recordings need their schema)."""
    if source not in SOURCES:
        raise ValueError(f"source={source!r} is invalid: {', '.join(SOURCES)} (any game: recordings with an "
                         f"actions.yaml beside them)")
    if source == "recordings" and space is None:
        raise ValueError(f"{jsonl.parent}: recordings need their action schema (actions.yaml)")
    records, notes = read_jsonl(jsonl)
    encoder = action_space(space or source)
    if source != "vpt":
        ids, keep, more = encode_records(records, encoder)
        return ids, keep, notes + more
    actions, keep, more = parse_vpt(records, drop_null, drop_gui)
    ids = np.zeros((len(records), encoder.n_a), np.int64)
    for i, a in enumerate(actions):
        if a is not None and keep[i]:
            ids[i] = encoder.encode(a)
    return ids, np.array(keep, bool), notes + more


def read_schema(folder: str | Path) -> dict:
    """A recordings folder's action schema (actions.yaml / .json), checked: a SchemaError names the file and
    field."""
    import yaml

    folder = Path(folder)
    path = next((folder / n for n in SCHEMA_FILES if (folder / n).is_file()), None)
    if path is None:
        raise FileNotFoundError(f"{folder}: no action schema: write actions.yaml beside the recordings "
                                f"(docs/own-game.md), or record them with mcar record")
    try:
        schema = yaml.safe_load(path.read_text())  # JSON is YAML
    except yaml.YAMLError as e:
        raise SchemaError(f"{path}: not YAML/JSON ({str(e).splitlines()[0]})") from None
    try:
        action_space(schema)
    except SchemaError as e:
        raise SchemaError(f"{path}: {e}") from None
    return schema
