"""What a token shard must be, checked once and recorded in index.json, so that a start reads no shard in full.

An episode's shards: <name>.frames.npy (T, h, w) and <name>.actions.npy (T, n_a), non-negative integers, T > 0 on
both. `shard_stats` reads both once (when the index is built; the tokeniser describes the arrays it has just
written instead: `describe_shard`) and records T, the grid, n_a, the id ranges and the files' sizes; `check_entry`
then holds an index entry against the data config without reading the data. A shard whose size changed since is
read again. Every failure names the file, the field and, for an id out of range, the first frame holding it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

REMEDY = "a corrupt or foreign shard: delete it (the next run re-tokenises it and rebuilds index.json)"


class ShardError(ValueError):
    pass


def shard_paths(folder: str | Path, name: str) -> tuple[Path, Path]:
    folder = Path(folder)
    return folder / f"{name}.frames.npy", folder / f"{name}.actions.npy"


def open_shard(path: Path) -> np.ndarray:
    """The shard memory-mapped (nothing read yet); a file that is not a plain .npy array is named."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise ShardError(f"{path}: missing ({REMEDY})") from None
    except Exception as e:  # truncated, empty, pickled objects, not .npy at all
        raise ShardError(f"{path}: not a readable .npy array ({type(e).__name__}: {e}); {REMEDY}") from None
    if arr.dtype.kind not in "ui":
        raise ShardError(f"{path}: dtype {arr.dtype}, not integer token ids (a float or object shard would be "
                         f"truncated or refused deep inside torch); {REMEDY}")
    return arr


def shard_bytes(folder: str | Path, name: str) -> int:
    return sum(p.stat().st_size for p in shard_paths(folder, name))


def shard_stats(folder: str | Path, name: str) -> dict:
    """Read an episode's two shards once: -> the index entry (frames, grid, n_a, id ranges, bytes)."""
    frames_path, actions_path = shard_paths(folder, name)
    return describe_shard(folder, name, open_shard(frames_path), open_shard(actions_path))


def describe_shard(folder: str | Path, name: str, toks: np.ndarray, acts: np.ndarray) -> dict:
    """The index entry of an episode's shards from their arrays: memory-mapped (shard_stats), or the arrays the
    tokeniser has just written (nothing read back); `bytes` are the files' sizes on disk."""
    frames_path, actions_path = shard_paths(folder, name)
    if toks.ndim != 3 or acts.ndim != 2:
        raise ShardError(f"{frames_path if toks.ndim != 3 else actions_path}: shape "
                         f"{toks.shape if toks.ndim != 3 else acts.shape}, not (T, h, w) image ids and (T, n_a) "
                         f"action ids; {REMEDY}")
    if len(toks) == 0 or len(toks) != len(acts):
        raise ShardError(f"{actions_path}: {len(acts)} frames of actions for {len(toks)} frames of image tokens "
                         f"in {frames_path.name}: both must hold the same number, and more than 0; {REMEDY}")
    entry = {"name": name, "frames": int(len(toks)), "grid": list(toks.shape[1:]), "n_a": int(acts.shape[1]),
             "image_ids": [int(toks.min()), int(toks.max())],
             "action_ids": [int(acts.min()), int(acts.max())] if acts.size else [0, 0],
             "bytes": shard_bytes(folder, name)}
    for key, path, arr in (("image_ids", frames_path, toks), ("action_ids", actions_path, acts)):
        if entry[key][0] < 0:
            raise ShardError(f"{path}: id {entry[key][0]} at frame {first_frame(arr, arr < 0)} is negative; "
                             f"{REMEDY}")
    return entry


def first_frame(arr: np.ndarray, bad: np.ndarray) -> int:
    return int(np.argwhere(bad.reshape(len(arr), -1).any(1))[0][0])


def ids_out_of_range(toks: np.ndarray, acts: np.ndarray, codebook_size: int,
                     action_vocab_size: int | None) -> tuple[int, str, int, int, int] | None:
    """The first vocabulary a clip's ids overflow, as (0 for image ids or 1 for action ids, its config field, its
    size, the largest id, the first frame holding an id out of range); None when every id fits (the check each
    clip read gets: TokenClips from shards, StreamClips from a stream)."""
    for which, arr, vocab, field in ((0, toks, codebook_size, "data.codebook_size"),
                                     (1, acts, action_vocab_size, "data.action_vocab_size")):
        if vocab is not None and arr.size and int(arr.max()) >= vocab:
            return which, field, vocab, int(arr.max()), first_frame(arr, arr >= vocab)
    return None


def check_entry(folder: str | Path, entry: dict, grid: tuple[int, int], n_a: int, codebook_size: int,
                action_vocab_size: int | None) -> None:
    """An index entry against the data config (data.h, data.w, data.n_a, the vocabularies), reading no data
    unless an id is out of range (then the first frame holding it is looked up, for the message)."""
    frames_path, actions_path = shard_paths(folder, entry["name"])
    if tuple(entry["grid"]) != tuple(grid) or entry["n_a"] != n_a:
        raise ShardError(f"{Path(folder)}/{entry['name']}: tokens {tuple(entry['grid'])} x {entry['n_a']} actions "
                         f"per frame, but data.h, data.w, data.n_a = {grid[0]}, {grid[1]}, {n_a}")
    for key, path, vocab, what, field in (("image_ids", frames_path, codebook_size, "image token",
                                           "data.codebook_size"),
                                          ("action_ids", actions_path, action_vocab_size, "action id",
                                           "data.action_vocab_size")):
        if vocab is not None and entry[key][1] >= vocab:
            arr = open_shard(path)
            raise ShardError(f"{path}: {what} {entry[key][1]} (first at frame {first_frame(arr, arr >= vocab)}) is "
                             f"out of range for {field}={vocab}; {REMEDY}")


ENTRY_FIELDS = {"name": str, "frames": int, "grid": list, "n_a": int, "image_ids": list, "action_ids": list,
                "bytes": int}


def entry_problem(entry) -> str | None:
    """Why `entry` is not an index entry as we write them (the field and what it holds); None when it is."""
    if not isinstance(entry, dict):
        return f"an entry is {type(entry).__name__}, not an object"
    for field, kind in ENTRY_FIELDS.items():
        value = entry.get(field)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{entry.get('name', '?')}: field {field!r} is {value!r}, not {kind.__name__}"
    if len(entry["grid"]) != 2 or any(len(entry[k]) != 2 for k in ("image_ids", "action_ids")) or not all(
            isinstance(v, int) for k in ("grid", "image_ids", "action_ids") for v in entry[k]):
        return f"{entry['name']}: grid, image_ids and action_ids must be pairs of integers"
    return None


def index_problem(index) -> str | None:
    """Why a parsed index.json is not one we write ({"meta": {...}, "episodes": [entries]}); None when it is."""
    if not isinstance(index, dict) or not isinstance(index.get("episodes"), list):
        return "no \"episodes\" list"
    if not isinstance(index.get("meta", {}), dict):
        return "\"meta\" is not an object"
    return next(filter(None, map(entry_problem, index["episodes"])), None)


def current_entry(folder: str | Path, entry: dict | None, name: str) -> dict:
    """The index's entry when it describes this shard as it is on disk: a well-formed entry, the files' sizes, and
    the frame count, grid and n_a in the .npy headers (a few hundred bytes read). Else the shards are read and
    described again: a lying or stale entry never survives a rebuild. Its id ranges are trusted here; every clip
    read is checked again against the vocabularies (TokenClips.clip)."""
    if entry_problem(entry) is None and entry["name"] == name and entry["bytes"] == shard_bytes(folder, name):
        frames_path, actions_path = shard_paths(folder, name)
        toks, acts = open_shard(frames_path), open_shard(actions_path)
        if toks.shape == (entry["frames"], *entry["grid"]) and acts.shape == (entry["frames"], entry["n_a"]):
            return entry
    return shard_stats(folder, name)
