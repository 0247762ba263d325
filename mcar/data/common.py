"""What every data source shares: clip sources, a step-indexed batch order, and the LightningDataModule.

Exact resume: the batch of global step s on rank r is a pure function of (seed, s, r). The train loader is a
sequence of steps starting at the trainer's restored global step, so a resumed run sees exactly the batches
an uninterrupted one would have seen.
"""
from __future__ import annotations

import os
import re
from typing import Protocol

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from mcar.core.layout import Layout


class ClipSource(Protocol):
    """A set of clips in the docs/diagd.md layout: `clip(i)` is a (frames * frame_len,) long tensor."""

    layout: Layout
    frames: int

    def __len__(self) -> int: ...

    def clip(self, i: int) -> torch.Tensor: ...


MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit integers in which every input bit flips each output bit
    with probability ~1/2 (the Feistel round function and the key schedule)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class EpochPermutation:
    """A keyed pseudo-random permutation of range(n), one position at a time in O(1) expected, no table.

    A balanced Feistel network permutes [0, 4^b), the smallest such domain >= n (so two halves of b bits);
    positions that land in [n, 4^b) are sent through it again (cycle walking) until they land in range, which
    keeps it a bijection of range(n). n >= 4^b / 4, so that takes at most 4 passes on average.
    """

    ROUNDS = 6  # 4 already make a strong pseudo-random permutation (Luby-Rackoff); 2 more for tiny domains

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise ValueError(f"cannot permute {n} items")
        self.n = n
        self.half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self.half_mask = (1 << self.half_bits) - 1
        key = mix64(mix64(seed & MASK64) ^ (epoch & MASK64))
        self.keys = [mix64(key + r) for r in range(self.ROUNDS)]

    def _feistel(self, x: int) -> int:
        left, right = x >> self.half_bits, x & self.half_mask
        for k in self.keys:
            left, right = right, left ^ (mix64(right ^ k) & self.half_mask)
        return (left << self.half_bits) | right

    def __getitem__(self, k: int) -> int:
        if not 0 <= k < self.n:
            raise IndexError(k)
        x = self._feistel(k)
        while x >= self.n:
            x = self._feistel(x)
        return x


def clip_indices(n_clips: int, batch_size: int, seed: int, step: int, rank: int = 0, world: int = 1) -> list[int]:
    """The clips of rank `rank` at global step `step`: positions step*B*world + rank*B ... of an endless walk
    through per-epoch permutations of all clips (every epoch visits each clip once; the ranks of a step split
    the world-size-1 batch of B*world clips into consecutive slices)."""
    per_step = batch_size * world
    first = step * per_step + rank * batch_size
    perms: dict[int, EpochPermutation] = {}
    out = []
    for g in range(first, first + batch_size):
        epoch, k = divmod(g, n_clips)
        if epoch not in perms:
            perms[epoch] = EpochPermutation(n_clips, seed, epoch)
        out.append(perms[epoch][k])
    return out


class StepBatches(Dataset):
    """Item s is the whole (B, N) batch of global step s for this rank."""

    def __init__(self, source: ClipSource, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        if len(source) == 0:
            raise ValueError("the training set has no usable clips")
        self.source, self.batch_size, self.seed, self.rank, self.world = source, batch_size, seed, rank, world

    def __len__(self) -> int:  # effectively endless; the trainer stops at max_steps
        return 2**62

    def indices(self, step: int) -> list[int]:
        return clip_indices(len(self.source), self.batch_size, self.seed, step, self.rank, self.world)

    def __getitem__(self, step: int) -> dict:
        idx = self.indices(step)
        return {"tokens": torch.stack([self.source.clip(i) for i in idx]), "clip_index": torch.tensor(idx)}


class StepsFrom(Sampler):
    """Yields step numbers start, start+1, ... (the trainer stops the loop)."""

    def __init__(self, start: int):
        self.start = start

    def __iter__(self):
        s = self.start
        while True:
            yield s
            s += 1

    def __len__(self) -> int:
        return 2**62


def cores_per_process(local_processes: int) -> int:
    """This training process's share of the CPU cores: SLURM's cpus_per_task when it started one task per GPU
    (conf/cluster/slurm.yaml), else the cores this process may run on split among the machine's processes."""
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit():
        return int(slurm)
    return len(os.sched_getaffinity(0)) // local_processes


class ClipDataModule(L.LightningDataModule):
    """Wraps a train and a val ClipSource; subclasses implement `make_sources()` (and `prepare_data()`)."""

    def __init__(self, layout: Layout, clip_frames: int, batch_size: int, seed: int = 0,
                 num_workers: int | None = None, val_clips: int = 8):
        super().__init__()
        if clip_frames < 2:
            raise ValueError(f"data.clip_frames must be >= 2 (a prompt frame and a target), got {clip_frames}")
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        self.layout, self.clip_frames, self.batch_size = layout, clip_frames, batch_size
        self.seed, self.num_workers, self.val_clips = seed, num_workers, val_clips
        self.train_source: ClipSource | None = None
        self.val_source: ClipSource | None = None

    def make_sources(self) -> tuple[ClipSource, ClipSource]:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.train_source is None:
            self.train_source, self.val_source = self.make_sources()

    def _rank_world(self) -> tuple[int, int]:
        t = self.trainer
        return (t.global_rank, t.world_size) if t is not None else (0, 1)

    def _on_gpu(self) -> bool:
        t = self.trainer
        return t.strategy.root_device.type == "cuda" if t is not None else torch.cuda.is_available()

    def loader_workers(self) -> int:
        """data.num_workers, or for null: up to 4 per GPU process (a few clips a step keep them ahead of any
        GPU step), none on CPU (there the workers would take cores from the training step itself)."""
        if self.num_workers is not None:
            return int(self.num_workers)
        if not self._on_gpu():
            return 0
        local_processes = self.trainer.num_devices if self.trainer is not None else 1
        return max(1, min(4, cores_per_process(local_processes) - 1))  # one core left to the training process

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        start = 0
        if self.trainer is not None:  # restored on resume before the loaders are built
            start = self.trainer.global_step * self.trainer.accumulate_grad_batches
        ds = StepBatches(self.train_source, self.batch_size, self.seed, rank, world)
        # workers get consecutive steps round-robin and the loader hands batches back in sampler order, so
        # the step order (and exact resume) does not depend on the number of workers
        workers = self.loader_workers()
        return DataLoader(ds, batch_size=None, sampler=StepsFrom(start), num_workers=workers,
                          persistent_workers=workers > 0, pin_memory=self._on_gpu())

    def val_dataloader(self) -> DataLoader:
        n = min(self.val_clips, len(self.val_source))
        if n == 0:
            raise ValueError("the validation set has no usable clips")
        clips = torch.stack([self.val_source.clip(i) for i in range(n)])
        rank, world = self._rank_world()
        mine = clips[rank::world] if len(clips) >= world else clips
        batches = [{"tokens": b} for b in mine.split(self.batch_size)]
        return DataLoader(batches, batch_size=None)


def complete_data_config(cfg) -> None:
    """A data module whose config comes partly from its files (data=recordings: the token grid, the action schema)
    fills its `auto` fields in now, before anything reads them: its class's `complete_config(cfg)`."""
    import hydra

    target = cfg.get("data", {}).get("_target_")
    complete = getattr(hydra.utils.get_class(target), "complete_config", None) if target else None
    if complete is not None:
        complete(cfg)


def build_datamodule(data_cfg, **overrides) -> "ClipDataModule":
    """The `data` config group instantiated (`_target_`), strictly: a key its datamodule does not take (a
    misspelling in conf/data/*.yaml or on the command line) is an error naming it, not silently ignored."""
    import hydra

    try:
        return hydra.utils.instantiate(data_cfg, _recursive_=False, **overrides)
    except Exception as e:  # Hydra wraps what the datamodule's __init__ raised
        unknown = re.search(r"unexpected keyword argument '(\w+)'", str(e))
        if unknown is None:
            if isinstance(e.__cause__, ValueError):  # our own message, naming the field: as is, unwrapped
                raise e.__cause__ from None
            raise
        raise ValueError(f"data.{unknown.group(1)} is not a setting of {data_cfg.get('_target_')} (data.name="
                         f"{data_cfg.get('name')}): misspelled? (the data config group: conf/data/)") from None


def check_vocab(codebook_size: int, action_vocab_size: int, vocab_size: int | None) -> None:
    """data.vocab_size, where a config states it, is the model's vocabulary: image codes, then action ids."""
    if vocab_size is not None and vocab_size != codebook_size + action_vocab_size:
        raise ValueError(f"data.vocab_size={vocab_size} must equal data.codebook_size + data.action_vocab_size = "
                         f"{codebook_size} + {action_vocab_size} = {codebook_size + action_vocab_size}")
