"""Every file a job writes (checkpoints, videos, images, tables, JSON, CSV) is written whole or not at all: into a
temp name beside it, unique to this process and host (two writers never share one), flushed to disk, then renamed
over the target. A reader sees the old file or the new one, never half of one; a kill, a stop signal or a full
disk leaves the old file (or none) and no temp file, and a full disk says "no space left on <folder>"."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path


def temp_path(path: str | Path, suffix: str = ".tmp", keep_suffix: bool = False) -> Path:
    """A temp name beside `path`, unique to this process and host (two machines writing into one shared folder
    may share a pid): `.<name>.<host>.<pid><suffix>`, or `.<stem>.<host>.<pid>.part<path's suffix>`."""
    path = Path(path)
    if keep_suffix:
        return path.with_name(f".{path.stem}.{socket.gethostname()}.{os.getpid()}.part{path.suffix}")
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}{suffix}")


def no_space_error(path: Path, e: OSError) -> OSError:
    """A full disk said with the folder and the file (unless already said so); any other error as it is."""
    if e.errno == errno.ENOSPC and not str(e.strerror or "").startswith("no space left on"):
        return OSError(errno.ENOSPC, f"no space left on {path.parent} while writing {path.name}")
    return e


@contextlib.contextmanager
def written_atomically(path: str | Path, keep_suffix: bool = False, suffix: str = ".tmp") -> Iterator[Path]:
    """-> a temp path to write `path`'s content to (by name: PIL, av, torch.save, csv); when the block ends it is
    flushed and renamed over `path`, when it raises (a stop signal too) removed. keep_suffix: the temp name ends
    in `path`'s own suffix (writers that pick the format by it); `suffix` the temp name's ending otherwise (never a
    name a reader globs for, e.g. *.ckpt)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path, suffix, keep_suffix)
    try:
        yield tmp
        if tmp.is_file():  # a folder (a sharded checkpoint) has no one file to flush
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        said = no_space_error(path, e) if isinstance(e, OSError) else e
        if said is e:
            raise
        raise said from e


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write `data` (text as UTF-8) to `path` atomically."""
    with written_atomically(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)


def write_json(path: str | Path, obj, indent: int = 1) -> Path:
    return write_atomic(path, json.dumps(obj, indent=indent) + "\n")
