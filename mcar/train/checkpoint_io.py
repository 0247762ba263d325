"""Checkpoint files: written atomically, read with a clear error, checked tensor by tensor against a model."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """Stream to a temporary file, then rename: a kill mid-save never corrupts the last good checkpoint, and
    the checkpoint is never held in memory as one byte string (Lightning's default does; a 700M model's
    10 GB checkpoint then runs a 24 GiB machine out of memory)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(checkpoint, tmp)
        os.replace(tmp, path)


def is_sharded_checkpoint(path: Path) -> bool:
    """A folder of per-rank shards (torch.distributed.checkpoint) with Lightning's meta.pt beside them."""
    return path.is_dir() and (path / "meta.pt").is_file()


def load_checkpoint(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"PK\x03\x04" and head[:1] != b"\x80":  # torch.save's zip archive, or its legacy pickle
        raise ValueError(f"{path} is not a checkpoint written by torch.save: it starts with {head!r}, not a zip "
                         f"archive (a text file, or the wrong path?)")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # truncated or not a checkpoint at all
        raise ValueError(f"cannot read checkpoint {path}: {e}") from e


def check_state_shapes(module: torch.nn.Module, state: dict, source: str) -> None:
    """Raise a clear error naming every tensor whose name or shape differs from the module's."""
    own = module.state_dict()
    wrong = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
             for k, v in state.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if wrong or missing or unexpected:
        lines = wrong + [f"{k}: missing in checkpoint" for k in missing] + \
                [f"{k}: not in this model" for k in unexpected]
        shown = "\n  ".join(lines[:20]) + (f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else "")
        raise ValueError(f"checkpoint {source} does not fit this model ({len(lines)} tensors differ):\n  {shown}")
