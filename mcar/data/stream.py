"""Token shards as a LitData stream: clips read from a local folder or an object-store URL, split across ranks,
nodes and loader workers by LitData, resumed mid-epoch exactly from the loader state Lightning checkpoints.

    mcar tokenize ... stream=/data/vpt_stream          # or, for shards already made: mcar.data.stream.pack_stream
    python train.py data=stream data.stream_dir=s3://bucket/vpt_stream vq=amused vq.path=/weights/vq

A stream folder holds two LitData datasets, `train/` and `val/` (the last `val_episodes` episodes by name, as the
local path splits them), and `pack.json` (what was packed, from which tokens; for a URL, in the object store
beside them, through LitData's own client). One item is one clip: `frames` (clip_frames, h, w) and `actions`
(clip_frames, n_a) uint16 ids, `episode`, `start`. Training clips start every
`stride` frames of an episode (stride < clip_frames stores overlapping windows: more distinct clips, more
bytes); validation clips do not overlap. Items are packed from an indexed tokens folder, so every shard was
checked against its geometry and vocabularies once (mcar.data.shards) before it was written.

LitData (not webdataset or mosaicml-streaming): measured in BENCHMARKS.md "Data at VPT scale".
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import torch

from mcar.atomic import temp_path, write_json
from mcar.data.common import ClipDataModule, check_vocab
from mcar.data.files import read_json, writing_into
from mcar.data.index import current_index, split_by_episode
from mcar.data.shards import ShardError, check_entry, ids_out_of_range, shard_paths
from mcar.tokenizer.clips import join_clip

FORMAT = "mcar-stream-1"


def _litdata():
    try:
        import litdata

        import mcar.data.stream_dataset  # noqa: F401  (LitData without its PyPI version query)
    except ImportError as e:
        if not (e.name or "").startswith("litdata"):
            raise
        raise ImportError("the streaming data path needs LitData: pip install 'mcar[stream]'") from None
    return litdata


def clip_starts(frames: int, clip_frames: int, stride: int) -> range:
    return range(0, frames - clip_frames + 1, stride)


def episode_clips(name: str, tokens_dir: str, clip_frames: int, stride: int):
    """LitData's optimize step for one episode: yields its clips as stream items."""
    frames_path, actions_path = shard_paths(tokens_dir, name)
    toks, acts = np.load(frames_path, mmap_mode="r"), np.load(actions_path, mmap_mode="r")
    for t in clip_starts(len(toks), clip_frames, stride):
        yield {"frames": np.ascontiguousarray(toks[t:t + clip_frames], dtype=np.uint16),
               "actions": np.ascontiguousarray(acts[t:t + clip_frames], dtype=np.uint16),
               "episode": name, "start": int(t)}


def pack_stream(tokens_dir: str | Path, out: str, clip_frames: int, stride: int | None = None,
                val_episodes: int = 2, chunk_bytes: str = "64MB", workers: int | None = None) -> dict:
    """An indexed tokens folder (mcar tokenize) -> the stream at `out` (a folder or an object-store URL that
    LitData writes to). Episodes shorter than a clip are left out. -> what pack.json records."""
    litdata = _litdata()
    tokens_dir, stride = Path(tokens_dir), stride or clip_frames
    if stride < 1 or clip_frames < 2:
        raise ValueError(f"stream clip_frames={clip_frames} (>= 2) and stride={stride} (>= 1)")
    index = current_index(tokens_dir)  # a stale index is rebuilt (or refused), never packed from
    meta = index.get("meta", {})
    entries = [e for e in index["episodes"] if e["frames"] >= clip_frames]
    for e in entries:  # each shard's recorded id ranges against the folder's vocabularies
        check_entry(tokens_dir, e, tuple(e["grid"]), e["n_a"], meta.get("codebook_size", 2**16),
                    meta.get("action_vocab_size"))
    grids = {(tuple(e["grid"]), e["n_a"]) for e in entries}
    if len(grids) > 1:
        raise ShardError(f"{tokens_dir}: episodes of several geometries {sorted(grids)}: one stream holds one")
    train, val = split_by_episode([e["name"] for e in entries], val_episodes)
    frames = {e["name"]: e["frames"] for e in entries}
    workers = workers or max(1, min(len(train), os.cpu_count() or 1))
    (grid, n_a), = grids
    clip_bytes = 2 * clip_frames * (grid[0] * grid[1] + n_a)  # uint16 frames and actions
    clips = sum(len(clip_starts(frames[n], clip_frames, stride)) for n in train) + \
        sum(len(clip_starts(frames[n], clip_frames, clip_frames)) for n in val)
    if not is_url(out):
        check_free_space(Path(out), clips * clip_bytes)
    with packing_into(out) as staging, own_litdata_cache():
        for split, names, split_stride in (("train", train, stride), ("val", val, clip_frames)):
            # inputs largest first: the optimize workers' shares end together
            names = sorted(names, key=lambda n: -frames[n])
            litdata.optimize(fn=partial(episode_clips, tokens_dir=str(tokens_dir), clip_frames=clip_frames,
                                        stride=split_stride),
                             inputs=names, output_dir=f"{staging.rstrip('/')}/{split}", chunk_bytes=chunk_bytes,
                             num_workers=min(workers, len(names)), mode="overwrite", reorder_files=False,
                             start_method="fork")  # fork: callers need no __main__ guard
        record = {"format": FORMAT, "tokens_dir": str(tokens_dir.resolve()), "tokens_meta": meta,
                  "h": grid[0], "w": grid[1], "n_a": n_a, "clip_frames": clip_frames, "stride": stride,
                  "train_episodes": len(train), "val_episode_names": val,
                  "train_clips": sum(len(clip_starts(frames[n], clip_frames, stride)) for n in train),
                  "val_clips": sum(len(clip_starts(frames[n], clip_frames, clip_frames)) for n in val)}
        write_pack_record(staging, record)
    return record


PACK_OVERHEAD = 1.1  # LitData's chunk headers and item framing over the raw clip bytes


def check_free_space(target: Path, clip_bytes: int) -> None:
    """Refuse, in one line and before any worker starts, a pack that cannot fit its disk (the stream is staged
    beside `target`, LitData's chunks in the temp folder): a full disk inside LitData's workers prints their
    tracebacks before our error."""
    needed = int(clip_bytes * PACK_OVERHEAD)
    place = next(p for p in (target, *target.parents) if p.exists())
    folders = [place, Path(tempfile.gettempdir())]
    on_disk = [os.stat(f).st_dev for f in folders]  # one disk for both: LitData's chunks and their copy at once
    for folder, disk in dict(zip(folders, on_disk)).items():
        free, needed_here = shutil.disk_usage(folder).free, needed * on_disk.count(disk)
        if free < needed_here:
            raise OSError(errno.ENOSPC, f"no space left on {folder} for the stream {target.name}: it needs "
                                        f"~{needed_here / 2**20:,.0f} MiB, {free / 2**20:,.0f} MiB are free; free some "
                                        f"or pack to another disk")


@contextlib.contextmanager
def packing_into(out: str):
    """-> where to pack the stream `out`. A local stream is packed beside it under a lock on its name (one pack at a
    time), then swapped in: a pack that fails (a full disk) leaves the old stream whole and no partial chunks. An
    object-store URL is written in place."""
    if is_url(out):
        yield out
        return
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    with writing_into(target.parent, f"the stream {target.name}", f".{target.name}.mcar-pack.lock"):
        for suffix in ("packing", "replaced"):  # a killed pack's: we hold the name's lock, so no pack runs
            for stale in target.parent.glob(f".{target.name}.*.{suffix}"):
                shutil.rmtree(stale, ignore_errors=True)
        staging, old = temp_path(target, ".packing"), temp_path(target, ".replaced")
        try:
            yield str(staging)
        except BaseException as e:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left" in str(e):
                raise OSError(errno.ENOSPC, f"no space left on {target.parent} while packing {target.name}: the "
                                            f"old stream is whole, the partial one removed") from None
            raise
        if target.exists():
            target.rename(old)
        staging.rename(target)
        shutil.rmtree(old, ignore_errors=True)


LITDATA_CACHE_VARS = ("DATA_OPTIMIZER_CACHE_FOLDER", "DATA_OPTIMIZER_DATA_CACHE_FOLDER")


@contextlib.contextmanager
def own_litdata_cache():
    """LitData's optimize stages chunks in one folder per machine (/tmp/chunks), emptied by each run at its start:
    two packs at once broke each other (one crashed, one left a stream with a chunk missing). Each pack gets its own
    folder, removed afterwards however the pack ends (a full disk left 31 MB behind)."""
    saved = {v: os.environ.get(v) for v in LITDATA_CACHE_VARS}
    remove_dead_packs_caches()
    own = tempfile.mkdtemp(prefix=f"mcar-pack-{os.getpid()}-")
    try:
        os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = os.path.join(own, "chunks")
        os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = os.path.join(own, "data")
        yield own
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        shutil.rmtree(own, ignore_errors=True)


def remove_dead_packs_caches() -> None:
    """/tmp/mcar-pack-<pid>-* folders of packs whose process is gone (kill -9: no `finally` ran)."""
    for folder in Path(tempfile.gettempdir()).glob("mcar-pack-*"):
        pid = folder.name.split("-")[2]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    return True


def is_url(location: str) -> bool:
    return "://" in str(location)


def object_store(url: str):
    """LitData's client for an object-store URL (s3://, gs://): the same credentials its streams use."""
    from litdata.streaming.fs_provider import _get_fs_provider

    return _get_fs_provider(url)


def write_pack_record(out: str, record: dict) -> None:
    """pack.json beside the stream's train/ and val/: in the folder, or uploaded beside them in the object store."""
    if not is_url(out):
        write_json(Path(out) / "pack.json", record)
        return
    with tempfile.TemporaryDirectory() as tmp:
        write_json(Path(tmp) / "pack.json", record)
        object_store(out).upload_file(str(Path(tmp) / "pack.json"), f"{out.rstrip('/')}/pack.json")


def read_pack_record(stream_dir: str) -> tuple[dict | None, str]:
    """-> (pack.json of the stream, or None where it has none; where it was read)."""
    where = f"{stream_dir.rstrip('/')}/pack.json"
    if not is_url(stream_dir):
        return (read_json(Path(where)) if Path(where).exists() else None), where
    store = object_store(stream_dir)
    if not store.exists(where):
        return None, where
    with tempfile.TemporaryDirectory() as tmp:
        store.download_file(where, str(Path(tmp) / "pack.json"))
        return read_json(Path(tmp) / "pack.json"), where


class StreamClips:
    """Items of a LitData dataset as clips in the docs/diagd.md layout (checked against the data config)."""

    def __init__(self, h: int, w: int, n_a: int, clip_frames: int, codebook_size: int, source: str,
                 action_vocab_size: int | None = None):
        self.h, self.w, self.n_a, self.clip_frames = h, w, n_a, clip_frames
        self.codebook_size, self.action_vocab_size, self.source = codebook_size, action_vocab_size, source

    def __call__(self, item: dict) -> torch.Tensor:
        toks, acts = item["frames"], item["actions"]
        if toks.shape != (self.clip_frames, self.h, self.w) or acts.shape != (self.clip_frames, self.n_a):
            raise ShardError(f"{self.source}: item of episode {item.get('episode')} holds frames {toks.shape} and "
                             f"actions {acts.shape}, but data.clip_frames, data.h, data.w, data.n_a = "
                             f"{self.clip_frames}, {self.h}, {self.w}, {self.n_a}: pack the stream again for them")
        bad = ids_out_of_range(toks, acts, self.codebook_size, self.action_vocab_size)
        if bad:
            which, field, vocab, top, frame = bad
            raise ShardError(f"{self.source}: item of episode {item.get('episode')} holds {('image', 'action')[which]} "
                             f"id {top} at frame {frame} of the clip, out of range for {field}={vocab}: the stream "
                             f"was packed from other data")
        return join_clip(toks, acts, self.codebook_size)


def _clip_dataset(url: str, to_clip: StreamClips, **kw):
    _litdata()
    from mcar.data.stream_dataset import ClipStream

    try:
        return ClipStream(url, to_clip, **kw)
    except ShardError:
        raise
    except (FileNotFoundError, ValueError) as e:
        raise FileNotFoundError(f"{url}: not a LitData stream ({e}); make one with `mcar tokenize ... stream=` "
                                f"(mcar.data.stream)") from None


def collate_clips(clips: list[torch.Tensor]) -> dict:
    return {"tokens": torch.stack(clips)}


class ValClips:
    """ClipSource over the validation stream: its items in stored order (random access)."""

    def __init__(self, dataset, layout, frames: int):
        self.dataset, self.layout, self.frames = dataset, layout, frames

    def __len__(self) -> int:
        return len(self.dataset)

    def clip(self, i: int) -> torch.Tensor:
        return self.dataset[i]


class StreamDataModule(ClipDataModule):
    """Clips from a stream (pack_stream): LitData's StreamingDataLoader shuffles (seeded), splits the clips across
    ranks, nodes and workers, and is resumed mid-epoch from the state Lightning keeps in the checkpoint."""

    def __init__(self, stream_dir: str, h: int, w: int, n_a: int, codebook_size: int, action_vocab_size: int,
                 clip_frames: int, batch_size: int, seed: int = 0, num_workers: int | None = None,
                 val_clips: int = 8, cache_dir: str | None = None, max_cache_size: str = "100GB",
                 name: str | None = None, vocab_size: int | None = None, actions: str | None = None):
        from mcar.core.layout import Layout

        super().__init__(Layout(h, w, n_a), clip_frames, batch_size, seed, num_workers, val_clips)
        check_vocab(codebook_size, action_vocab_size, vocab_size)
        self.stream_dir, self.cache_dir, self.max_cache_size = str(stream_dir).rstrip("/"), cache_dir, max_cache_size
        self.codebook_size, self.action_vocab_size, self.name, self.actions = (codebook_size, action_vocab_size,
                                                                              name, actions)

    def check_pack(self) -> None:
        """The stream's pack.json (local or in the object store) against the data config: geometry, clip length
        and vocabularies (its items' shapes are checked again as they come)."""
        pack, record = read_pack_record(self.stream_dir)
        if pack is None:
            return
        meta = pack.get("tokens_meta", {})
        for key, want in [("h", self.layout.h), ("w", self.layout.w), ("n_a", self.layout.n_a),
                          ("clip_frames", self.clip_frames), ("codebook_size", self.codebook_size),
                          ("action_vocab_size", self.action_vocab_size)]:
            have = pack.get(key, meta.get(key))
            if have is not None and have != want:
                raise ValueError(f"{record}: the stream was packed with {key}={have} but data.{key}={want}")

    def make_sources(self):
        self.check_pack()
        kw = dict(cache_dir=self.cache_dir, max_cache_size=self.max_cache_size)
        clips = lambda split: StreamClips(self.layout.h, self.layout.w, self.layout.n_a, self.clip_frames,
                                          self.codebook_size, f"{self.stream_dir}/{split}", self.action_vocab_size)
        train = _clip_dataset(f"{self.stream_dir}/train", clips("train"), shuffle=True, seed=self.seed,
                              drop_last=True, **kw)
        val = _clip_dataset(f"{self.stream_dir}/val", clips("val"), shuffle=False, **kw)
        return train, ValClips(val, self.layout, self.clip_frames)

    def train_dataloader(self):
        from mcar.data.stream_dataset import ClipLoader

        workers = self.loader_workers()
        return ClipLoader(self.train_source, batch_size=self.batch_size, num_workers=workers,
                          collate_fn=collate_clips, drop_last=True, persistent_workers=workers > 0,
                          pin_memory=self._on_gpu())
