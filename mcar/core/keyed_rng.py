"""Keyed randomness for the samplers: the noise behind output (b, slot) is a hash of (seed, batch row b, slot, value),
so the eager and the static path (any padding, any bucketing, any pass order) draw the same tokens for the same
seed, with no RNG state and no host sync."""
from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32), in int64 without overflow (c in two 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x):
    """lowbias32 (C. Wellons), a bijective 32-bit hash; on Python ints and int64 tensors alike."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed: int | None) -> int:
    """A 32-bit key from any integer seed; None draws one from torch's global RNG (CPU: no device sync)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()))
    return mix32(mix32(seed & _M32) ^ ((seed >> 32) & _M32))


def value_codes(n: int, device=None) -> torch.Tensor:
    """(n,) int64: the hashed code of each value v < n (so keys close in value give unrelated rows)."""
    return mix32(torch.arange(n, device=device))


def keyed_exponential(key: torch.Tensor, n: int, codes: torch.Tensor | None = None) -> torch.Tensor:
    """key (...) int64 -> (..., n) float32 Exp(1) draws, element v a function of (key, v) alone.
    codes: `value_codes(n)`, when the caller keeps them (a sampler computes them once, not per pass)."""
    codes = value_codes(n, key.device) if codes is None else codes
    bits = mix32(key[..., None] ^ codes)
    u = ((bits >> 8).float() + 0.5) * 2.0**-24  # 24 bits: exact in float32, never 0 or 1
    return -torch.log(u)


@dataclass
class SlotNoise:
    """The keys of a keyed sampling run, hashed once before its passes (each op costs ~5 us per pass on CPU):
    output (b, slot) draws `keyed_exponential(keys[b, slot], n, codes)`."""

    keys: torch.Tensor  # (B, n_slots) int64: mix32(mix32(seed key ^ b) ^ slot)
    codes: torch.Tensor  # (n,) int64: value_codes(n), n the number of values sampled from

    @classmethod
    def of(cls, key: int, batch: int, n_slots: int, n_values: int, device) -> "SlotNoise":
        return cls(mix32(row_keys(key, batch, device) ^ torch.arange(n_slots, device=device)),
                   value_codes(n_values, device))


def row_keys(key: int, batch: int, device) -> torch.Tensor:
    """(batch, 1) int64: the key of each batch row; output (b, slot) draws with key mix32(row_keys[b] ^ slot)."""
    return mix32(torch.tensor(key, device=device) ^ torch.arange(batch, device=device))[:, None]
