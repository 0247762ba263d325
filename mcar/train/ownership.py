"""A run owns its output and checkpoint directories, checked before the first step.

Each directory gets a kernel lock (`.mcar-run.lock`, mcar.data.files.FolderLock: the file names pid, host, start
time and run name) taken by global rank 0. A second live run that asks for the same directory is refused with a
message naming the owner; the kernel drops a killed run's lock, so the next run takes it at once. Taking the lock
is also the writability check: an unwritable directory fails now, not at the first checkpoint after minutes of
work.

A fresh run (no ckpt_path) refuses a checkpoint directory that already holds checkpoints: Lightning would add
`-v1` files beside them and `ckpt_path=last` would later resume the other run's weights.
"""
from __future__ import annotations

import atexit
import os
from pathlib import Path

from mcar.data.files import FolderLock

LOCK = ".mcar-run.lock"


def global_rank() -> int:
    """The process's global rank from the launcher's environment (0 when not distributed)."""
    for var in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    if os.environ.get("LOCAL_RANK", "0") != "0":  # a process Lightning spawned on this node
        return int(os.environ["LOCAL_RANK"])
    return 0


_HELD: dict[Path, FolderLock] = {}  # this process's locks, by lock file


def claim(folder: str | Path, what: str, run_name: str) -> Path | None:
    """Create `folder` and lock it for this run (global rank 0 only; others just create the folder and return
    None). Raises a clear error if the folder cannot be written or a live run holds it; released when the process
    exits, however it exits (a kernel lock), or by `release`."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PermissionError(f"{what} {folder} cannot be created ({e.strerror}): choose a writable location") from e
    if global_rank() != 0:
        return None
    path = (folder / LOCK).resolve()
    if path in _HELD and _HELD[path].held:  # a forked child holds none of its parent's locks
        return path  # this process already owns it (e.g. output dir == checkpoint dir)
    lock = FolderLock(folder, LOCK)
    try:
        taken = lock.acquire(blocking=False, run_name=run_name)
    except OSError as e:
        raise PermissionError(f"{what} {folder} is not writable ({e.strerror}): choose a writable location") from e
    if not taken:
        owner = lock.owner()
        raise RuntimeError(
            f"{what} {folder} belongs to another run that is still going (run_name={owner.get('run_name')!r}, "
            f"pid {owner.get('pid')} on {owner.get('host')}, started {owner.get('started')}): give this run "
            f"another run_name (or paths.output_dir / hydra.run.dir), or wait for it")
    _HELD[path] = lock
    atexit.register(release, path)
    return path


def release(lock: Path | None) -> None:
    held = _HELD.pop(Path(lock).resolve(), None) if lock is not None else None
    if held is not None:
        held.release()


def check_fresh_checkpoint_dir(folder: str | Path, run_name: str) -> None:
    """A run without ckpt_path must not write into another run's checkpoints."""
    found = sorted(p.name for p in Path(folder).glob("*.ckpt")) if Path(folder).is_dir() else []
    if found:
        shown = ", ".join(found[:3]) + (" ..." if len(found) > 3 else "")
        raise FileExistsError(
            f"checkpoint dir {folder} already holds checkpoints of run '{run_name}' ({shown}): resume it with "
            f"ckpt_path=last, or start a new run with another run_name (or delete the folder)")
