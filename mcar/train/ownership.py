"""A run owns its output and checkpoint directories, checked before the first step.

Each directory gets a lock file (`.mcar-run.lock`: pid, host, start time, run name) created atomically by global
rank 0. A second live run that asks for the same directory is refused with a message naming the owner; a lock
left by a killed run (its pid is gone on this host) is taken over. Creating the lock is also the writability
check: an unwritable directory fails now, not at the first checkpoint after minutes of work.

A fresh run (no ckpt_path) refuses a checkpoint directory that already holds checkpoints: Lightning would add
`-v1` files beside them and `ckpt_path=last` would later resume the other run's weights.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import time
from pathlib import Path

LOCK = ".mcar-run.lock"


def global_rank() -> int:
    """The process's global rank from the launcher's environment (0 when not distributed)."""
    for var in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    if os.environ.get("LOCAL_RANK", "0") != "0":  # a process Lightning spawned on this node
        return int(os.environ["LOCAL_RANK"])
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(folder: str | Path, what: str, run_name: str) -> Path | None:
    """Create `folder` and its lock for this run (the lock by global rank 0 only; others just create the folder and
    return None). Raises a clear error if the folder cannot be written or a live run owns it; released when the
    process exits (or by `release`)."""
    folder = Path(folder)
    if global_rank() != 0:
        folder.mkdir(parents=True, exist_ok=True)
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PermissionError(f"{what} {folder} cannot be created ({e.strerror}): choose a writable location") from e
    lock = folder / LOCK
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
          "run_name": run_name}
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = json.loads(lock.read_text())
            except (OSError, ValueError):
                owner = {}
            if owner.get("pid") == os.getpid() and owner.get("host") == me["host"]:
                return lock  # this process already owns it (e.g. output dir == checkpoint dir)
            if owner.get("host") == me["host"] and isinstance(owner.get("pid"), int) and not _alive(owner["pid"]):
                lock.unlink(missing_ok=True)  # left by a killed run: take over
                continue
            raise RuntimeError(
                f"{what} {folder} belongs to another run that is still going (run_name={owner.get('run_name')!r}, "
                f"pid {owner.get('pid')} on {owner.get('host')}, started {owner.get('started')}): give this run "
                f"another run_name (or paths.output_dir / hydra.run.dir), or wait for it; if that run is gone, "
                f"delete {lock}") from None
        except OSError as e:
            raise PermissionError(f"{what} {folder} is not writable ({e.strerror}): choose a writable location") from e
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        atexit.register(release, lock)
        return lock
    raise RuntimeError(f"could not take the lock {lock}")


def release(lock: Path | None) -> None:
    if lock is None:
        return
    try:
        owner = json.loads(lock.read_text())
        if owner.get("pid") == os.getpid():
            lock.unlink()
    except (OSError, ValueError):
        pass


def check_fresh_checkpoint_dir(folder: str | Path, run_name: str) -> None:
    """A run without ckpt_path must not write into another run's checkpoints."""
    found = sorted(p.name for p in Path(folder).glob("*.ckpt")) if Path(folder).is_dir() else []
    if found:
        shown = ", ".join(found[:3]) + (" ..." if len(found) > 3 else "")
        raise FileExistsError(
            f"checkpoint dir {folder} already holds checkpoints of run '{run_name}' ({shown}): resume it with "
            f"ckpt_path=last, or start a new run with another run_name (or delete the folder)")
