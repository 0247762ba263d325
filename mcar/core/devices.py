"""Device helpers shared by every layer above core: the `device=auto` choice and a CUDA synchronisation point."""
from __future__ import annotations

import os

import torch


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """device=auto|cpu|cuda|cuda:1 (None: auto) -> a torch.device; auto: CUDA when present, else CPU."""
    if isinstance(name, torch.device):
        return name
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (timing on GPU); nothing on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_threads(n: int | None) -> int:
    """threads=N: torch's CPU threads for this process (0 or null: torch's default, one per core) -> those in use.
    On a small shared machine 1 thread is the faster choice for sampling (BENCHMARKS.md, "threads")."""
    if n:
        torch.set_num_threads(int(n))
    return torch.get_num_threads()

def device_memory(device: torch.device) -> int:
    """Bytes of memory on `device`: the GPU's total, or this machine's RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
