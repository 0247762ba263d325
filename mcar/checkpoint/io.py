"""Checkpoint files: written atomically, read as weights only (a file from elsewhere never runs code), with a clear
error, and checked tensor by tensor against a model."""
from __future__ import annotations

import errno
import pickle
import re
import shutil
from pathlib import Path

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from mcar.atomic import written_atomically

LOW_SPACE = 64 * 2**20  # torch.save on a full disk fails with a bare 'unexpected pos'; this little free space says why


class AtomicCheckpointIO(TorchCheckpointIO):
    """Stream to a temporary file, then rename: a kill mid-save never corrupts the last good checkpoint, and
    the checkpoint is never held in memory as one byte string (Lightning's default does; a 700M model's
    10 GB checkpoint then runs a 24 GiB machine out of memory)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        path = Path(path)
        with written_atomically(path) as tmp:  # its temp name ends in .tmp: never taken for a *.ckpt
            try:
                torch.save(checkpoint, tmp)
            except BaseException as e:
                free = shutil.disk_usage(path.parent).free  # before the partial file goes: it may hold the space
                if getattr(e, "errno", None) == errno.ENOSPC or (isinstance(e, (OSError, RuntimeError))
                                                                 and free < LOW_SPACE):
                    raise OSError(errno.ENOSPC, f"no space left on {path.parent} ({free / 2**20:.0f} MiB free) "
                                                f"while saving {path.name}; the earlier checkpoints are intact") from e
                raise

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        """Lightning's resume (`ckpt_path=`) reads weights only too, whatever its caller asks."""
        return load_weights_only(path, "checkpoint")


def is_sharded_checkpoint(path: Path) -> bool:
    """A folder of per-rank shards (torch.distributed.checkpoint) with Lightning's meta.pt beside them."""
    return path.is_dir() and (path / "meta.pt").is_file()


# what torch.distributed.checkpoint's .metadata legitimately holds: its metadata dataclasses, sizes, dtypes, paths
SHARD_METADATA_GLOBALS = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "Path"), ("torch.serialization", "_get_layout")}


class _ShardMetadataUnpickler(pickle.Unpickler):
    """Python's restricted unpickler: only the globals above (and torch dtypes) may be named, so nothing else can be
    built or called."""

    def find_class(self, module, name):
        if (module, name) in SHARD_METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                         torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: {module}.{name}")


def check_sharded_checkpoint(path: str | Path) -> None:
    """A sharded checkpoint folder, read as data only before Lightning resumes from it: torch.distributed.checkpoint
    reads its .metadata with plain pickle (any object, so any code), so that file is read here first with only the
    checkpoint-metadata classes allowed, and meta.pt as weights only; either holding more is refused by name."""
    path = Path(path)
    load_weights_only(path / "meta.pt", "sharded checkpoint's meta.pt")
    metadata = path / ".metadata"
    if not metadata.is_file():
        raise FileNotFoundError(f"sharded checkpoint {path} has no .metadata (torch.distributed.checkpoint's index "
                                f"of the shards): not a complete checkpoint")
    try:
        with open(metadata, "rb") as f:
            _ShardMetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise ValueError(f"refused to load sharded checkpoint {path}: its .metadata holds more than "
                         f"torch.distributed.checkpoint's metadata ({e}), and unpickling that could run code") \
            from None
    except Exception as e:  # truncated, not a pickle at all
        raise ValueError(f"cannot read sharded checkpoint {path}/.metadata: {type(e).__name__}: {e}") from e


def load_weights_only(path: str | Path, what: str = "checkpoint", mmap: bool = False) -> dict:
    """torch.load with weights_only=True: tensors and plain Python data, never code. A file that holds anything else
    (a pickled object whose unpickling could run code, e.g. one calling os.system) is refused, naming the file and
    the object it asked for."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"PK\x03\x04" and head[:1] != b"\x80":  # torch.save's zip archive, or its legacy pickle
        raise ValueError(f"{path} is not a {what} written by torch.save: it starts with {head!r}, not a zip "
                         f"archive (a text file, or the wrong path?)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and head == b"PK\x03\x04")
    except pickle.UnpicklingError as e:
        asked = re.search(r"(Unsupported (?:global|operand)[^\n.]*)", str(e))
        raise ValueError(f"refused to load {what} {path}: it holds more than tensors and plain data "
                         f"({asked.group(1) if asked else 'an object weights-only loading does not allow'}), and "
                         f"unpickling that could run code. mcar loads weights only: if you trust the file, save "
                         f"its tensors alone (a state_dict) with torch.save and load that.") from None
    except Exception as e:  # truncated or not a checkpoint at all
        raise ValueError(f"cannot read {what} {path}: {e}") from e


def load_checkpoint(path: str | Path) -> dict:
    """A training checkpoint (ours, a colleague's, a converted one), weights only."""
    return load_weights_only(path, "checkpoint", mmap=True)


def check_state_shapes(module: torch.nn.Module, state: dict, source: str) -> None:
    """Raise a clear error naming every tensor whose name or shape differs from the module's."""
    own = module.state_dict()
    wrong = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
             for k, v in state.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if split := next((k for k in unexpected if k.endswith("feed_forward.w1.weight")), None):
        raise ValueError(f"checkpoint {source}: {split}: separate gate (w1) and up (w3) weights; the model holds "
                         f"them as one feed_forward.w13 = [w1; w3]: concatenate each layer's pair (torch.cat, dim 0) "
                         f"and re-save")
    if wrong or missing or unexpected:
        lines = wrong + [f"{k}: missing in checkpoint" for k in missing] + \
                [f"{k}: not in this model" for k in unexpected]
        shown = "\n  ".join(lines[:20]) + (f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else "")
        raise ValueError(f"checkpoint {source} does not fit this model ({len(lines)} tensors differ):\n  {shown}")
