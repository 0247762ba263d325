"""The statistics of every comparison mcar reports, in one place: percentile bootstrap intervals over clips or
starts (evaluate's rows, the world tests' per-start scores), a two-level bootstrap over seeds and clips (table3),
intervals of paired differences (two models on the same clips or worlds, start by start).
"""
from __future__ import annotations

import math

import torch


def bootstrap_ci(per_clip: torch.Tensor, pool, seed: int = 0, resamples: int = 1000,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap over clips: `resamples` draws of len(per_clip) clips with replacement (seeded), `pool`
    ((R, n) per-clip values -> (R,) statistics, the row value's own formula) on each -> the central `level`
    interval (low, high). The order statistics are taken as they are (no interpolation: inf stays inf)."""
    values = per_clip.double().cpu()
    g = torch.Generator().manual_seed(seed)
    return central(pool(values[torch.randint(len(values), (resamples, len(values)), generator=g)]), level)


def resample_seeds_and_clips(n_seeds: list[int], n_clips: int, seed: int = 0,
                             resamples: int = 1000) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The draws of a two-level bootstrap over models trained with several seeds, all scored on the same clips:
    for each model, (resamples, its seeds) seed indices drawn with replacement; one (resamples, n_clips) clip index
    draw shared by every model (the clips are paired across models)."""
    g = torch.Generator().manual_seed(seed)
    clips = torch.randint(n_clips, (resamples, n_clips), generator=g)
    return [torch.randint(s, (resamples, s), generator=g) for s in n_seeds], clips


def pooled_draws(values: torch.Tensor, seeds: torch.Tensor, clips: torch.Tensor, pool) -> torch.Tensor:
    """(S, n) per-clip values of S seeds -> (resamples,) `pool` of the drawn seeds' drawn clips (each draw: the
    seeds `seeds[r]`, each on the clips `clips[r]`, pooled together)."""
    drawn = values.double()[seeds[:, :, None], clips[:, None, :]]  # (R, S, n)
    return pool(drawn.flatten(1))


def central(draws: torch.Tensor, level: float = 0.95) -> tuple[float, float]:
    """The central `level` interval of bootstrap draws, order statistics as they are (as bootstrap_ci)."""
    d = draws.double().sort().values
    tail, last = (1 - level) / 2, len(d) - 1
    return float(d[math.floor(tail * last)]), float(d[math.ceil((1 - tail) * last)])


def interval(per_start: torch.Tensor, seed: int) -> dict:
    """per-start values -> {mean, lo, hi, n, per_start}: the mean and its 95% bootstrap interval over starts, and the
    values (the same starts for every model: two runs compare paired, start by start)."""
    v = per_start.double()
    lo, hi = bootstrap_ci(v, lambda x: x.mean(-1), seed)
    return {"mean": float(v.mean()), "lo": lo, "hi": hi, "n": len(v), "per_start": [round(float(x), 6) for x in v]}


def paired_interval(mine, theirs, seed: int) -> dict:
    """Two rows' per-start values (the same starts, in order) -> interval() of their difference, start by start."""
    return interval(torch.as_tensor(mine, dtype=torch.float64) - torch.as_tensor(theirs, dtype=torch.float64), seed)


def pooled_interval(values: torch.Tensor, starts, seed: int) -> dict:
    """per-event values and the start each came from -> {mean: over the events, lo, hi: its 95% bootstrap interval
    over starts (starts drawn with replacement, their events pooled: events of one start are not independent draws;
    None with fewer than 2 starts), n: events, starts}."""
    v = values.double()
    _, which = torch.unique(torch.as_tensor(starts), return_inverse=True)
    k = int(which.max()) + 1
    per = torch.stack([torch.zeros(k, dtype=torch.float64).index_add_(0, which, v),
                       torch.bincount(which, minlength=k).double()], 1)  # (starts, [sum, events])
    lo = hi = None
    if k >= 2:
        lo, hi = bootstrap_ci(per, lambda x: x[..., 0].sum(-1) / x[..., 1].sum(-1), seed)
    return {"mean": float(v.mean()), "lo": lo, "hi": hi, "n": len(v), "starts": k}
