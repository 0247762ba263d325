"""Clips from token shards (mcar.data.tokenize): the docs/diagd.md layout, split by episode.

A clip is `frames` consecutive kept frames of one episode; clip starts step by `clip_stride`. Clip slot layout:
per frame its h*w image ids (raster order), then its n_a action ids + codebook_size.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from mcar.core.layout import Layout
from mcar.data.common import ClipDataModule, check_vocab
from mcar.data.index import read_index, refresh_index, split_by_episode
from mcar.data.shards import (
    REMEDY,
    ShardError,
    check_entry,
    current_entry,
    ids_out_of_range,
    open_shard,
    shard_paths,
)
from mcar.tokenizer.clips import join_clip


class TokenClips:
    """ClipSource over token shards of the given episodes, in O(episodes) memory: clip i's (episode, first frame)
    is arithmetic over the episodes' cumulative clip counts (np.searchsorted), not a table of every start, and a
    clip reads just its own frames from the two .npy files (os.pread at an offset from the file's header, read
    once per episode): no shard is mapped, so a loader worker's memory does not grow with the corpus and no
    kernel limit on mappings is met. Clips run episode by episode in `names` order, each episode's starting at
    frames 0, clip_stride, 2 * clip_stride, ..."""

    def __init__(self, folder: str | Path, names: list[str], layout: Layout, frames: int, codebook_size: int,
                 clip_stride: int = 1, action_vocab_size: int | None = None, entries: dict | None = None):
        """Every shard is held against the layout and the vocabularies (mcar.data.shards) through its index entry
        (`entries`, by name: no data read when it is current; without one the shard is read once): a bad shard
        is named, with the field and the frame, not found as an IndexError inside the model at step 0."""
        if clip_stride < 1:
            raise ValueError(f"data.clip_stride={clip_stride}: it must be >= 1")
        self.layout, self.frames, self.codebook_size, self.clip_stride = layout, frames, codebook_size, clip_stride
        self.action_vocab_size = action_vocab_size
        self.folder, self.episode_names, entries = Path(folder), list(names), entries or {}
        lengths = []
        for name in self.episode_names:
            entry = current_entry(self.folder, entries.get(name), name)
            check_entry(self.folder, entry, (layout.h, layout.w), layout.n_a, codebook_size, action_vocab_size)
            lengths.append(int(entry["frames"]))
        self.lengths = np.asarray(lengths, dtype=np.int64)  # frames per episode
        counts = np.maximum(0, (self.lengths - frames) // clip_stride + 1)  # clip starts per episode
        self.ends = np.cumsum(counts)  # clips of episodes 0..e: episode e holds clips ends[e-1] .. ends[e]-1
        self._headers: dict[int, tuple] = {}  # episode -> per file (path, data offset, dtype, frame shape)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def locate(self, i: int) -> tuple[int, int]:
        """Clip i -> (episode index, first frame)."""
        if not 0 <= i < len(self):
            raise IndexError(f"clip {i} of {len(self)}")
        e = int(np.searchsorted(self.ends, i, side="right"))
        return e, int(i - (self.ends[e - 1] if e else 0)) * self.clip_stride

    def _header(self, e: int) -> tuple:
        if e not in self._headers:
            self._headers[e] = tuple(npy_header(path) for path in shard_paths(self.folder, self.episode_names[e]))
        return self._headers[e]

    def frames_of(self, e: int, t: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Frames t .. t+n-1 of episode e: ((n, h, w) image ids, (n, n_a) action ids), read from disk."""
        return tuple(read_rows(h, t, n) for h in self._header(e))

    def clip(self, i: int) -> torch.Tensor:
        e, t = self.locate(i)
        toks, acts = self.frames_of(e, t, self.frames)
        bad = ids_out_of_range(toks, acts, self.codebook_size, self.action_vocab_size)
        if bad:  # the index's ranges were wrong
            which, field, vocab, top, frame = bad
            raise ShardError(f"{shard_paths(self.folder, self.episode_names[e])[which]}: id {top} at frame "
                             f"{t + frame} is out of range for {field}={vocab}, though index.json said otherwise; "
                             f"{REMEDY}")
        return join_clip(toks, acts, self.codebook_size)  # (F * frame_len,)


def npy_header(path: Path) -> tuple[Path, int, np.dtype, tuple[int, ...]]:
    """A .npy shard -> (path, offset of its data, dtype, shape of one row), checked as open_shard checks it (the
    mapping it makes to read the header is dropped at once)."""
    arr = open_shard(path)
    if not arr.flags.c_contiguous:
        raise ShardError(f"{path}: a Fortran-order array; {REMEDY}")
    return path, int(arr.offset), arr.dtype, tuple(arr.shape[1:])


def read_rows(header: tuple, t: int, n: int) -> np.ndarray:
    """Rows t .. t+n-1 of the .npy file `header` describes, with one pread."""
    path, offset, dtype, row_shape = header
    row_bytes = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, n * row_bytes, offset + t * row_bytes)
    finally:
        os.close(fd)
    if len(data) != n * row_bytes:
        raise ShardError(f"{path}: rows {t}..{t + n - 1} run past its end (a truncated shard); {REMEDY}")
    return np.frombuffer(data, dtype=dtype).reshape(n, *row_shape)


class TokenDataModule(ClipDataModule):
    """Train/val clips from a tokens folder; subclasses make the folder in prepare_data()."""

    def __init__(self, h: int, w: int, n_a: int, codebook_size: int, action_vocab_size: int, clip_frames: int,
                 batch_size: int, seed: int = 0, num_workers: int = 0, val_clips: int = 8, val_episodes: int = 1,
                 clip_stride: int = 1, name: str | None = None, vocab_size: int | None = None,
                 actions: str | None = None, verify_shards: bool = False):
        """name: the config's; vocab_size: checked against codebook_size + action_vocab_size; actions: the action
        names' table (read by the tools: play, the IDM; VPT's datamodule also maps with it)."""
        super().__init__(Layout(h, w, n_a), clip_frames, batch_size, seed, num_workers, val_clips)
        check_vocab(codebook_size, action_vocab_size, vocab_size)
        self.name, self.actions = name, actions
        self.codebook_size, self.action_vocab_size = codebook_size, action_vocab_size
        self.val_episodes, self.clip_stride, self.verify_shards = val_episodes, clip_stride, verify_shards

    @property
    def tokens_dir(self) -> Path:
        raise NotImplementedError

    def check_meta(self, meta: dict) -> None:
        for key, want in [("codebook_size", self.codebook_size), ("n_a", self.layout.n_a),
                          ("action_vocab_size", self.action_vocab_size)]:
            if key in meta and meta[key] != want:
                raise ValueError(f"{self.tokens_dir}: tokens have {key}={meta[key]} but data.{key}={want}")

    def episode_names(self) -> list[str] | None:
        """The episodes this config asks for; None: every episode in the tokens folder."""
        return None

    def make_sources(self):
        refresh_index(self.tokens_dir)  # shards written, index not (a kill between them): rebuilt
        index = read_index(self.tokens_dir)
        self.check_meta(index.get("meta", {}))
        wanted = self.episode_names()
        usable = [e["name"] for e in index["episodes"] if e["frames"] >= self.clip_frames
                  and (wanted is None or e["name"] in wanted)]
        if not usable:
            raise ValueError(f"{self.tokens_dir}: no episode has data.clip_frames={self.clip_frames} frames "
                             f"({len(index['episodes'])} episodes)")
        train, val = split_by_episode(usable, self.val_episodes)
        # verify_shards: read every shard again (a full re-check), whatever the index says
        entries = {} if self.verify_shards else {e["name"]: e for e in index["episodes"]}
        make = lambda names, stride: TokenClips(self.tokens_dir, names, self.layout, self.clip_frames,
                                                self.codebook_size, stride, self.action_vocab_size, entries)
        # validation clips do not overlap: the first val_clips of them cover different frames
        return make(train, self.clip_stride), make(val, self.clip_frames)


class TokenFolderDataModule(TokenDataModule):
    """Train/val clips from a token folder made elsewhere (mcar tokenize, another machine, `mcar bench data`):
    nothing to build, only read."""

    def __init__(self, tokens_dir: str | Path, **kw):
        super().__init__(**kw)
        self._tokens_dir = Path(tokens_dir)

    @property
    def tokens_dir(self) -> Path:
        return self._tokens_dir
