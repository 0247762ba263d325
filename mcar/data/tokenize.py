"""Tokenisation job: episodes (mp4 + jsonl) -> per-episode token shards + an index.

For each episode <name>, in `out`:
    <name>.actions.npy  (T, n_a) uint16  action ids (local: 0..action vocab; the dataset adds codebook_size)
    <name>.frames.npy   (T, h, w) uint16 VQ token ids of the kept frames
    index.json          {"meta": {...}, "episodes": [{"name", "frames", "grid", "n_a", "image_ids", ...}, ...]}
    skipped.json        {name: reason} of the last run
    index.rank<r>.json, skipped.rank<r>.json   rank r's part of both (world > 1), until rank 0 merges them

Each shard is written to a temp name and renamed, frames last: a present frames file means a finished episode,
which later runs skip (resumable), and a failing episode never touches shards already written. Ranks split the
episodes by size (`balanced_share`: largest first, each to the least-loaded rank). Each rank describes its own
finished episodes in its part (a shard it wrote from the arrays in memory, one a killed run left by reading it),
and rank 0, once every rank is done, merges the parts into index.json (`merged_index`) reading no shard again;
a single rank (world = 1) merges its own part at once. `mcar tokenize` runs one rank per device over an
allocation (Lightning Fabric: devices=, num_nodes=; torchrun and SLURM tasks are found by Fabric), each printing
its frames/s.

    mcar tokenize episodes=data/crafter/episodes out=data/crafter/tokens source=crafter size=[224,384]
    mcar tokenize episodes=/vpt out=/data/vpt_tokens source=vpt vq=/path/vq size=[224,384] devices=8 num_nodes=4

(conf/tokenize.yaml.)

Frames are resized to `size` = (H, W) (the data modules pass their token grid times the VQ's downsampling).
"""
from __future__ import annotations

import heapq
import io
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from mcar.atomic import write_atomic, write_json
from mcar.data.episodes import EpisodeError, list_episodes, read_episode_actions
from mcar.data.files import read_json, writing_into
from mcar.data.index import index_entries, merged_index
from mcar.data.shards import ShardError, current_entry, describe_shard
from mcar.tokenizer.actions import action_space
from mcar.tokenizer.video import FrameStream


def _save_npy(path: Path, arr: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, arr)
    write_atomic(path, buf.getvalue())


VPT_SIZE = (360, 640)  # (H, W) of VPT's recordings


def tokenize_episode(mp4: Path, jsonl: Path, source: str, vq, batch: int = 16, drop_null: bool = True,
                     drop_gui: bool = True, size: tuple[int, int] | None = None, space: str | dict | None = None,
                     every: int = 1) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """-> (frame tokens (T, h, w) uint16 of the frames resized to size = (H, W) (None: as stored), action ids
    (T, n_a) uint16 in the action space `space` (a name or a schema; None: the source's), notes), every
    `every`-th recorded frame (a lower rate) with its action. Raises EpisodeError if unusable."""
    ids, keep, notes = read_episode_actions(jsonl, source, drop_null, drop_gui, space)
    if len(ids) == 0:
        raise EpisodeError("jsonl has no records")
    keep &= np.arange(len(keep)) % every == 0
    stream = FrameStream(mp4, size)
    tokens, kept = _encode_kept_frames(vq, stream, keep, batch)
    if stream.error and stream.count == 0:
        raise EpisodeError(f"unreadable mp4 ({stream.error})")
    notes += _video_notes(stream, source, size, len(ids))
    if not kept:
        raise EpisodeError("no usable frames (all filtered or unreadable)")
    return np.concatenate(tokens), ids[kept].astype(np.uint16), notes


def _encode_kept_frames(vq, stream: FrameStream, keep: np.ndarray, batch: int) -> tuple[list, list[int]]:
    """Encodes the kept frames `batch` at a time as they are decoded (an episode's frames need not fit in memory).
    -> (uint16 token arrays, one a batch; the kept frames' indices)."""
    from mcar.tokenizer.vq_model import encode_tokens

    buf, tokens, kept = [], [], []
    device = next(vq.parameters()).device

    def flush():
        if buf:
            ids = encode_tokens(vq, torch.from_numpy(np.stack(buf)).to(device))
            tokens.append(ids.cpu().numpy().astype(np.uint16))
            buf.clear()

    for i, frame in enumerate(stream):
        if i < len(keep) and keep[i]:
            buf.append(frame)
            kept.append(i)
            if len(buf) == batch:
                flush()
    flush()
    return tokens, kept


def _video_notes(stream: FrameStream, source: str, size: tuple[int, int] | None, n_records: int) -> list[str]:
    """What was trimmed or resized, once the stream is read: a decoding stop, a VPT video of another size, a frame
    count that differs from the records'."""
    notes = []
    if stream.error:
        notes.append(f"mp4 decoding stopped after {stream.count} frames ({stream.error}); trimmed")
    if source == "vpt" and stream.stored_size not in (None, VPT_SIZE):
        h, w = stream.stored_size
        notes.append(f"video is {w}x{h}, not VPT's {VPT_SIZE[1]}x{VPT_SIZE[0]}" +
                     (f": resized to {size[1]}x{size[0]}" if size else ""))
    if stream.count != n_records:
        notes.append(f"frame/record count mismatch: {stream.count} frames, {n_records} records; "
                     f"trimmed to {min(stream.count, n_records)}")
    return notes


def part_path(out: Path, rank: int) -> Path:
    """Rank `rank`'s index entries of its own episodes, until rank 0 merges them into index.json."""
    return out / f"index.rank{rank}.json"


def check_meta(out: Path, meta: dict) -> None:
    """Refuse to mix shards made with another VQ or action space in one folder."""
    f = out / "meta.json"
    if f.exists():
        old = read_json(f, "it records the VQ and action space of this folder's tokens: delete the folder")
        if old != meta:
            raise ValueError(f"{out} holds tokens made with {old}, not {meta}; use another tokens folder "
                             f"or delete this one")
    else:
        write_json(f, meta)


def balanced_share(found: list[tuple], rank: int, world: int) -> list[tuple]:
    """Rank `rank`'s episodes (name, mp4, jsonl) of `world`: largest mp4 first, each to the least-loaded rank (ties
    to the lower rank), so ranks end together when episode lengths vary 100x; every rank computes the same split
    from the same listing. Returned in name order."""
    loads = [(0, r) for r in range(world)]  # (bytes assigned, rank): a heap
    mine = []
    for size, i in sorted((-mp4.stat().st_size, i) for i, (_, mp4, _) in enumerate(found)):
        load, r = heapq.heappop(loads)
        heapq.heappush(loads, (load - size, r))
        if r == rank:
            mine.append(found[i])
    return sorted(mine, key=lambda episode: episode[0])


def describe_share(out: Path, names: list[str], written: dict, rank: int) -> list[dict]:
    """This rank's part: the index entries of its finished episodes, those written now from memory (`written`),
    those of an earlier run from the index or an unmerged part of this rank, and those no index describes (a
    killed run's) read here, by the rank that owns them, not by rank 0."""
    known = {**index_entries(out / "index.json"), **index_entries(part_path(out, rank))}
    mine = []
    for name in names:
        if name in written:
            mine.append(written[name])
        elif (out / f"{name}.frames.npy").exists():
            try:
                mine.append(current_entry(out, known.get(name), name))
            except ShardError:  # left to rank 0's merge, which names it past the barrier (no rank left waiting)
                pass
    return mine


def tokenize_dir(episodes: str | Path, out: str | Path, source: str, vq, vq_id: str, batch: int = 16,
                 min_frames: int = 2, drop_null: bool = True, drop_gui: bool = True, rank: int = 0,
                 world: int = 1, size: tuple[int, int] | None = None, space: str | dict | None = None,
                 stats: dict | None = None, every: int = 1) -> dict:
    """Tokenise every episode (this rank's share) not already done, frames resized to size = (H, W) (None: as
    stored), on the VQ's device, and describe the share in this rank's part of the index. -> world = 1: the
    index (merged_index); world > 1: this rank's part ({"meta", "episodes"}), which rank 0 merges with the others
    by `merged_index` once every rank is done. `stats` (if given) gets this rank's frames, seconds and frames/s;
    every: keep every `every`-th recorded frame.
    One process per rank writes into a folder at a time (a second waits, then skips what the first finished)."""
    out = Path(out)
    with writing_into(out, f"token shards (rank {rank} of {world})", f".mcar-writer.rank{rank}.lock"):
        return _tokenize_dir(episodes, out, source, vq, vq_id, batch, min_frames, drop_null, drop_gui, rank, world,
                             size, space, {} if stats is None else stats, every)


def _tokenize_dir(episodes, out: Path, source, vq, vq_id, batch, min_frames, drop_null, drop_gui, rank, world,
                  size, space, stats: dict, every: int) -> dict:
    meta = _folder_meta(source, vq, vq_id, drop_null, drop_gui, space, every)
    check_meta(out, meta)
    todo = balanced_share(_listed_episodes(episodes, rank), rank, world)
    skipped, written, done, encoded, t0 = {}, {}, 0, 0, time.perf_counter()
    progress = tqdm(todo, desc=f"tokenising {Path(episodes).name} (rank {rank} of {world})", unit="ep",
                    position=rank if world <= 8 else None)
    for name, mp4, jsonl in progress:
        if (out / f"{name}.frames.npy").exists():
            done += 1
            continue
        try:
            frames, actions, notes = tokenize_episode(mp4, jsonl, source, vq, batch, drop_null, drop_gui, size=size,
                                                      space=space, every=every)
            encoded += len(frames)
            progress.set_postfix(frames_per_s=f"{encoded / (time.perf_counter() - t0):.1f}")
            if len(frames) < min_frames:
                raise EpisodeError(f"only {len(frames)} usable frames, a clip needs {min_frames}")
        except EpisodeError as e:
            skipped[name] = str(e)
            warnings.warn(f"skipping episode {mp4}: {e}")
            continue
        except Exception as e:  # never lose the other episodes to one bad file
            skipped[name] = f"{type(e).__name__}: {e}"
            warnings.warn(f"skipping episode {mp4}: unexpected {type(e).__name__}: {e}")
            continue
        written[name] = _write_episode(out, name, mp4, frames, actions, notes)
        done += 1
    seconds = time.perf_counter() - t0
    stats.update(frames=encoded, seconds=seconds, frames_per_s=encoded / seconds if seconds > 0 else 0.0)
    device = next(vq.parameters()).device
    print(f"rank {rank} of {world} on {device}: {encoded} frames encoded in {seconds:.1f} s: "
          f"{stats['frames_per_s']:.1f} frames/s")
    part = _write_part(out, meta, [name for name, _, _ in todo], written, skipped, done, rank, world)
    return merged_index(out, meta, episodes) if world == 1 else part


def _folder_meta(source, vq, vq_id, drop_null, drop_gui, space, every) -> dict:
    """What a tokens folder's shards were made with (meta.json): one folder never mixes two."""
    encoder = action_space(space or source)
    meta = {"source": source, "vq": vq_id, "codebook_size": int(vq.quantize.n_e), "n_a": encoder.n_a,
            "action_vocab_size": encoder.vocab_size, "drop_null": drop_null, "drop_gui": drop_gui}
    if space not in (None, source):  # only then: folders tokenised before this option keep their meta
        meta["actions"] = space
    if every != 1:
        meta["every"] = every
    return meta


def _listed_episodes(episodes, rank: int) -> list[tuple]:
    """The folder's episodes (name, mp4, jsonl); rank 0 warns of jsonl files without an mp4."""
    found = list_episodes(episodes)
    orphans = sorted({p.stem for p in Path(episodes).glob("*.jsonl")} - {name for name, _, _ in found})
    if orphans and rank == 0:
        warnings.warn(f"{episodes}: {len(orphans)} jsonl files without an mp4 ignored: {orphans[:5]}"
                      f"{' ...' if len(orphans) > 5 else ''}")
    if not found:
        raise ValueError(f"no episodes (*.mp4 + *.jsonl) in {episodes}")
    return found


def _write_episode(out: Path, name: str, mp4: Path, frames: np.ndarray, actions: np.ndarray,
                   notes: list[str]) -> dict:
    """Warns each note and writes the episode's shards, frames last. -> its index entry (from memory)."""
    for note in notes:
        warnings.warn(f"{mp4}: {note}")
    _save_npy(out / f"{name}.actions.npy", actions)
    _save_npy(out / f"{name}.frames.npy", frames)  # last: its presence marks the episode finished
    return describe_shard(out, name, frames, actions)  # from memory: nothing read back


def _write_part(out: Path, meta: dict, names: list[str], written: dict, skipped: dict, done: int, rank: int,
                world: int) -> dict:
    """Writes this rank's part of the index and its skipped episodes, and says how the share went. -> the part."""
    part = {"meta": meta, "episodes": describe_share(out, names, written, rank)}
    mine = part["episodes"]
    write_json(part_path(out, rank), part)
    write_json(out / f"skipped.rank{rank}.json", skipped)
    print(f"rank {rank} of {world}: tokenised {done} of {len(names)} episodes ({sum(e['frames'] for e in mine)} "
          f"frames in {out}); skipped {len(skipped)}" + (f": {skipped}" if skipped else ""))
    return part
