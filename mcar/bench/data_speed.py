"""`mcar bench data`: the input pipeline at VPT scale on synthetic token shards of VPT geometry (14 x 24 image
tokens + 11 action ids a frame, 2,000-frame episodes), written once by the bench itself and cached:

    mcar bench data bench.data.frames=1000000 [bench.data.workers=4] [bench.data.path=stream]

bench.data.path: local (the .npy shards, data=tokens) or stream (the same frames packed once as a LitData stream,
data=stream; packing is timed as stream_packed_s). Measured: startup_s (a rank's data module from nothing to its
first batch: index or stream metadata, shard checks, loader and workers up), rss_mb_main (that rank's process),
rss_mb_per_worker / uss_mb_per_worker (each loader worker's resident and private memory, the largest),
data_ms_per_step (the main process's median wait for the next batch of bench.data.batch_size clips of
bench.data.clip_frames frames, 8 x 16 by default, over bench.data.steps steps, after warm-up steps).
Targets: start-up <= 5 s and <= 300 MB per worker at 10M frames, <= 1 ms of data per step at
8 x 16 frames."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from mcar.atomic import write_json
from mcar.data.shards import shard_bytes, shard_paths

VPT = {"h": 14, "w": 24, "n_a": 11, "codebook_size": 8192, "action_vocab_size": 71}


def synthetic_shards(folder: Path, frames: int, episode_frames: int, seed: int = 0) -> Path:
    """`frames` frames of VPT geometry as episodes of `episode_frames` (the last one shorter) in `folder`, with
    the index.json the tokeniser writes (its entries made from what was written: no shard read back). Cached:
    a folder whose index already says the same is used as it is."""
    folder = Path(folder)
    meta = {"source": "synthetic-vpt", "frames": frames, "episode_frames": episode_frames, "seed": seed,
            **{k: VPT[k] for k in ("codebook_size", "n_a", "action_vocab_size")}}
    index = folder / "index.json"
    if index.is_file():
        from mcar.data.index import read_index

        if read_index(folder).get("meta") == meta:
            return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    h, w, n_a, cb, av = (VPT[k] for k in ("h", "w", "n_a", "codebook_size", "action_vocab_size"))
    # one random block reused with a shift per episode: writing 10^7 frames stays disk-bound, not RNG-bound
    block_t = rng.integers(0, cb, (episode_frames, h, w), dtype=np.uint16)
    block_a = rng.integers(0, av, (episode_frames, n_a), dtype=np.uint16)
    entries, done, e = [], 0, 0
    while done < frames:
        T = min(episode_frames, frames - done)
        name = f"vpt_{e:06d}"
        toks, acts = np.roll(block_t, e, axis=0)[:T], np.roll(block_a, e, axis=0)[:T]
        frames_path, actions_path = shard_paths(folder, name)
        np.save(frames_path, toks), np.save(actions_path, acts)
        entries.append({"name": name, "frames": T, "grid": [h, w], "n_a": n_a,
                        "image_ids": [int(block_t.min()), int(block_t.max())],
                        "action_ids": [int(block_a.min()), int(block_a.max())], "bytes": shard_bytes(folder, name)})
        done, e = done + T, e + 1
    write_json(index, {"meta": meta, "episodes": entries})
    return folder


def memory_mb(pid: int) -> tuple[float, float]:
    """(resident, private) MB of a process, from /proc/<pid>/smaps_rollup (Linux)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])  # kB
    return fields["Rss"] / 1024, (fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)) / 1024


def worker_pids() -> list[int]:
    """This process's children (its loader workers; LitData's iterator does not expose them)."""
    me = os.getpid()
    return [int(p) for p in Path(f"/proc/{me}/task/{me}/children").read_text().split()]


def workers_memory_mb() -> list[tuple[float, float]]:
    """memory_mb of each child process still running: one that ends between the listing and the reading (another
    child of the caller than a loader worker, as under pytest) is left out, not an error."""
    found = []
    for pid in worker_pids():
        try:
            found.append(memory_mb(pid))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return found


def stream_of(folder: Path, clip_frames: int) -> tuple[Path, float]:
    """The shards of `folder` as a LitData stream beside them (packed once, cached) -> (its folder, seconds spent
    packing now)."""
    from mcar.data.files import read_json
    from mcar.data.stream import pack_stream

    out = folder.with_name(folder.name + f"_stream{clip_frames}")
    if (out / "pack.json").exists() and read_json(out / "pack.json").get("clip_frames") == clip_frames:
        return out, 0.0
    t0 = time.perf_counter()
    pack_stream(folder, str(out), clip_frames, val_episodes=1)
    return out, time.perf_counter() - t0


def data_module(path: str, folder: Path, clip_frames: int, batch_size: int, workers: int):
    geometry = dict(h=VPT["h"], w=VPT["w"], n_a=VPT["n_a"], codebook_size=VPT["codebook_size"],
                    action_vocab_size=VPT["action_vocab_size"], clip_frames=clip_frames, batch_size=batch_size,
                    num_workers=workers)
    if path == "stream":
        from mcar.data.stream import StreamDataModule

        return StreamDataModule(str(folder), **geometry)
    if path != "local":
        raise ValueError(f"bench.data.path={path!r}: local or stream")
    from mcar.data.token_clips import TokenFolderDataModule

    return TokenFolderDataModule(folder, val_episodes=1, **geometry)


def run_data(cfg: DictConfig) -> dict:
    from mcar.bench.speed import timed

    d = cfg.bench.data
    frames, clip_frames = int(d.frames), int(d.clip_frames)
    folder = Path(d.dir) / f"synthetic_vpt_{frames}f_{int(d.episode_frames)}"
    t0 = time.perf_counter()
    synthetic_shards(folder, frames, int(d.episode_frames))
    write_s, pack_s = time.perf_counter() - t0, None
    if d.path == "stream":
        folder, pack_s = stream_of(folder, clip_frames)

    t0 = time.perf_counter()
    dm = data_module(str(d.path), folder, clip_frames, int(d.batch_size), int(d.workers))
    dm.setup("fit")
    loader = dm.train_dataloader()
    batches = iter(loader)
    first = next(batches)
    startup_s = time.perf_counter() - t0
    prefetched = loader.num_workers * (loader.prefetch_factor or 0)
    seconds, _ = timed(lambda: next(batches), torch.device("cpu"), int(d.warmup_steps) + prefetched, int(d.steps))
    workers = workers_memory_mb()
    main_rss, _ = memory_mb(os.getpid())
    batches = loader = None  # ends the workers
    return dict(mode="data", path=str(d.path), frames=frames, clips=len(dm.train_source), clip_frames=clip_frames,
                batch_size=int(d.batch_size),
                batch_shape=list(first["tokens"].shape), workers=int(d.workers), startup_s=round(startup_s, 3),
                rss_mb_main=round(main_rss, 1),
                rss_mb_per_worker=round(max((r for r, _ in workers), default=0.0), 1),
                uss_mb_per_worker=round(max((u for _, u in workers), default=0.0), 1),
                data_ms_per_step=round(1000 * seconds, 3), shards_written_s=round(write_s, 1),
                stream_packed_s=None if pack_s is None else round(pack_s, 1), dir=str(folder))
