"""index.json of a tokens folder (mcar.data.tokenize writes the shards, mcar.data.token_clips reads clips from
them): built from the shards (each described once, mcar.data.shards), merged from the ranks' parts, found stale
and rebuilt, read and checked; and the split of its episodes into training and validation.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mcar.atomic import write_json
from mcar.data.files import read_json
from mcar.data.shards import ShardError, current_entry, entry_problem, index_problem, shard_bytes


def read_index(folder: str | Path) -> dict:
    f = Path(folder) / "index.json"
    if not f.exists():
        raise FileNotFoundError(f"{f} not found: run the tokenisation job first (mcar tokenize)")
    index = read_json(f, "delete it: the next run rebuilds it from the shards")
    problem = index_problem(index)
    if problem:
        raise ShardError(f"{f} is not an index of token shards ({problem}): delete it, the next run rebuilds it "
                         f"from the shards")
    return index


def split_by_episode(names: list[str], val_episodes: int) -> tuple[list[str], list[str]]:
    """The last `val_episodes` episodes (sorted by name) are validation, the rest training."""
    names = sorted(names)
    if len(names) <= val_episodes or val_episodes < 1:
        raise ValueError(f"data.val_episodes={val_episodes} needs more episodes than that and at least 1 "
                         f"(found {len(names)} usable episodes)")
    return names[:-val_episodes], names[-val_episodes:]


def index_entries(path: Path) -> dict:
    """{name: entry} of an index or a rank's part; {} when it is missing or unreadable (its shards are read)."""
    try:
        index = read_json(path)
    except (OSError, ValueError):
        return {}
    episodes = index.get("episodes") if isinstance(index, dict) else None
    return {e["name"]: e for e in episodes if entry_problem(e) is None} if isinstance(episodes, list) else {}


def read_skipped(out: Path) -> dict:
    """{name: reason} of the last run: skipped.json, and the ranks' parts not merged into it yet."""
    skipped = {}
    for f in [out / "skipped.json", *sorted(out.glob("skipped.rank*.json"))]:
        if f.exists():
            skipped.update(read_json(f))
    return skipped


def build_index(out: Path, meta: dict) -> dict:
    """index.json from the finished shards on disk, each checked and described once (mcar.data.shards: frames,
    grid, id ranges, sizes): the entry of the old index or of a rank's part whose recorded bytes match the files
    is kept as it is, only a shard neither describes is read. Then the ranks' parts are merged away (their
    skipped episodes into skipped.json)."""
    known = index_entries(out / "index.json")
    parts = sorted(out.glob("index.rank*.json"))
    for part in parts:
        known.update(index_entries(part))
    episodes = []
    for f in sorted(out.glob("*.frames.npy")):
        name = f.name[: -len(".frames.npy")]
        episodes.append(current_entry(out, known.get(name), name))
    index = {"meta": meta, "episodes": episodes}
    write_json(out / "index.json", index)
    skipped_parts = sorted(out.glob("skipped.rank*.json"))
    if skipped_parts:  # the ranks' episodes skipped by the last run, those since tokenised left out
        listed = {e["name"] for e in episodes}
        skipped = {}
        for f in skipped_parts:
            skipped.update(read_json(f))
        write_json(out / "skipped.json", {n: why for n, why in sorted(skipped.items()) if n not in listed})
    for f in parts + skipped_parts:
        f.unlink(missing_ok=True)
    return index


def merged_index(out: str | Path, meta: dict, episodes: str | Path) -> dict:
    """Rank 0 once every rank finished (or the only rank): index.json from the ranks' parts (build_index). Raises
    if no episode is usable."""
    out = Path(out)
    index = build_index(out, meta)
    if not index["episodes"]:
        skipped = read_skipped(out)
        raise ValueError(f"nothing usable in {episodes}: all {len(skipped)} episodes skipped ({skipped})")
    return index


def stale_index(out: str | Path, names: list[str] | None = None) -> str | None:
    """Why index.json does not describe the shards on disk (None: it does): unreadable, an episode whose shards
    are gone or hold another frame count, shards it does not list, or (names given) wanted episodes neither in
    it nor skipped. Reads the .npy headers only."""
    out = Path(out)
    try:
        index = read_json(out / "index.json")
    except (OSError, ValueError) as e:
        return str(e)
    problem = index_problem(index)
    if problem:
        return f"not an index of token shards ({problem})"
    listed = {e["name"]: e["frames"] for e in index.get("episodes", [])}
    on_disk = {f.name[: -len(".frames.npy")]: f for f in out.glob("*.frames.npy")}
    if set(on_disk) - set(listed):
        return f"shards not in the index: {sorted(set(on_disk) - set(listed))[:5]}"
    recorded = {e["name"]: e.get("bytes") for e in index.get("episodes", [])}
    for name, frames in listed.items():
        if name not in on_disk or not (out / f"{name}.actions.npy").exists():
            return f"{name}: listed, but its shards are gone"
        if recorded[name] is not None and recorded[name] != shard_bytes(out, name):
            return f"{name}: its shards changed since they were indexed"
        if np.load(on_disk[name], mmap_mode="r").shape[0] != frames:
            return f"{name}: listed with {frames} frames, its shard holds another count"
    skipped = read_skipped(out)
    missing = [n for n in names or [] if n not in listed and n not in skipped]
    if missing:
        return f"episodes neither tokenised nor skipped: {missing[:5]}"
    return None


def refresh_index(folder: str | Path) -> str | None:
    """Rebuild index.json when it does not describe the shards on disk (stale_index: a killed run's shards or
    parts, a shard deleted or replaced since), with the folder's meta.json, reading only the shards it does not
    describe. -> None when the index is current now; why it is stale when it cannot be rebuilt (no meta.json)."""
    folder = Path(folder)
    stale = stale_index(folder)
    if stale and (folder / "meta.json").exists():
        print(f"{folder}/index.json is stale ({stale}): rebuilt from the shards")
        build_index(folder, read_json(folder / "meta.json"))
        return None
    return stale


def current_index(folder: str | Path) -> dict:
    """index.json as it describes the shards on disk now (refresh_index); one that cannot be rebuilt is refused,
    naming the folder."""
    stale = refresh_index(folder)
    if stale and (Path(folder) / "index.json").exists():
        raise ValueError(f"{folder}/index.json does not describe the shards there ({stale}) and no meta.json says "
                         f"what made them: run `mcar tokenize` into {folder} again (it resumes, then rebuilds the "
                         f"index)")
    return read_index(folder)
