"""Static shapes for compiled sampling: the passes after the prefill grouped into a few buckets of one shape each.

A pass's rows are rounded up to one of at most `widths` row counts (`pass_widths`, a dynamic program), its visible
cache prefix to the longest in its bucket (buckets split the passes by generated frame). Padded rows read token 0,
write the scratch slot and see only themselves; padded outputs land in a dummy token column. Compiled, each bucket
is one CUDA graph. Nothing here knows the schedule's rules: it pads `PassPlan`s.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mcar.core.model import padded_attention_bias
from mcar.core.schedule import PassPlan

MAX_PREFIX_CLASSES = 16  # cache-prefix classes, one per generated frame up to this many
# bias row alignment (elements): the CUDA memory-efficient attention kernel pads (copies) a bias whose rows are not
# on 16 in every call; traced with dynamic shapes it pads whatever the width (BENCHMARKS.md)
BIAS_ALIGN = 16


class PassInputs(NamedTuple):
    """What one pass feeds and samples (a `PassPlan` has the same fields, unpadded)."""

    src: torch.Tensor  # (W,) long: token column of each input row (padding: 0)
    coords: torch.Tensor  # (W, 4) long
    mask: torch.Tensor  # (1, W, n+W) bool: [cache slots 0..n-1 | this pass's (padded) inputs]
    cache_pos: torch.Tensor  # (W,) long: cache slot written (proxies, padding: the scratch slot N)
    out_rows: torch.Tensor  # (O,) long: rows sampled (padding: row 0)
    out_slots: torch.Tensor  # (O,) long: token column written (padding: the dummy column N)


def pass_widths(rows: list[int], most: int) -> list[int]:
    """At most `most` widths, each a row count that occurs, the largest the widest pass: the set that pads
    the fewest rows in all when every pass is rounded up to the next width (dynamic programming)."""
    counts = Counter(rows)
    r = sorted(counts)
    upto = list(itertools.accumulate(counts[x] for x in r))  # passes with rows <= r[j]
    best = {(1, j): r[j] * upto[j] for j in range(len(r))}  # (n widths, largest r[j]) -> padded rows
    prev = {}
    for n in range(2, most + 1):
        for j in range(len(r)):
            for i in range(j):
                cost = best.get((n - 1, i), math.inf) + r[j] * (upto[j] - upto[i])
                if cost < best.get((n, j), math.inf):
                    best[n, j], prev[n, j] = cost, i
    last = len(r) - 1
    n = min((n for n in range(1, most + 1) if (n, last) in best), key=lambda n: best[n, last])  # fewest on ties
    widths, j = [], last
    while n >= 1:
        widths.append(r[j])
        j, n = prev.get((n, j)), n - 1
    return widths[::-1]


def no_lone_ones(sizes: list[int]) -> list[int]:
    """Sizes of one dimension across the buckets, 1 raised to 2 where another bucket's is larger: compiled with
    dynamic shapes, a size 1 is specialised (a graph of its own), so a step whose first pass had 1 row or output
    would compile again at the first larger one. Padding is free here (a padded row or output is masked)."""
    return sizes if max(sizes, default=1) == 1 else [max(x, 2) for x in sizes]


@dataclass
class Bucket:
    """Passes padded to one shape: P passes, W input rows, O sampled outputs, a cache prefix of n slots."""

    src: torch.Tensor  # (P, W) long: token column of each input row (padding: 0)
    coords: torch.Tensor  # (P, W, 4) long
    mask: torch.Tensor  # (P, 1, W, n+W) bool: [cache slots 0..n-1 | this pass's (padded) inputs]
    cache_pos: torch.Tensor  # (P, W) long: cache slot written (proxies, padding: the scratch slot N)
    out_rows: torch.Tensor  # (P, O) long: rows sampled (padding: row 0)
    out_slots: torch.Tensor  # (P, O) long: token column written (padding: the dummy column N)

    def pass_inputs(self, i: int) -> "PassInputs":
        """Pass i's inputs, copies: a view would make torch.compile guard on the bucket's pass count."""
        return PassInputs(*(t[i].clone() for t in (self.src, self.coords, self.mask, self.cache_pos, self.out_rows,
                                                   self.out_slots)))


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """A copy with the standard strides of its shape: clone keeps a view's strides where a dim has size 1 (a
    1-row bias sliced from its padded width), and dynamo guards on strides (a recompile per odd one)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)


class StagedBucket:
    """A bucket's passes as the compiled step reads them: one set of tensors at fixed addresses (`inputs`, marked
    static for CUDA graphs, the mask already the attention bias, contiguous) and `load(i)`, which puts pass i in
    them with two copies (its index rows in one multi-tensor copy, its bias in another). CUDA graphs copy a graph
    input that is not static into the graph at every replay, one kernel per tensor; a bias built inside the graph
    is built again per attention call. No input is a view with an offset: dynamo would guard on it (recompiles)."""

    def __init__(self, b: Bucket, groups: int, dtype):
        width = b.mask.shape[-1]
        self._tables = (b.src, b.coords, b.cache_pos, b.out_rows, b.out_slots)
        self._bias = padded_attention_bias(b.mask, groups, dtype)[..., :width].contiguous()[:, None]
        ints = [_fresh(t[0]) for t in self._tables]
        self.inputs = PassInputs(ints[0], ints[1], _fresh(self._bias[0]), *ints[2:])
        for t in self.inputs:
            torch._dynamo.mark_static_address(t, guard=False)
        self._ints = ints

    def load(self, i: int) -> PassInputs:
        torch._foreach_copy_(self._ints, [t[i] for t in self._tables])
        self.inputs.mask.copy_(self._bias[i])
        return self.inputs


@dataclass
class StaticPlan:
    buckets: list[Bucket]
    passes: list["PassInputs"]  # per pass after the prefill, in order: its `Bucket.pass_inputs`
    order: list[tuple[int, int]]  # per pass after the prefill, in order: (its bucket, its index there)
    real_rows: float  # mean input rows per pass before padding
    real_cols: float  # mean visible cache slots per pass (PassPlan.n_vis) before padding

    @property
    def rows_per_pass(self) -> float:
        return sum(a.src.shape[-1] for a in self.passes) / max(len(self.passes), 1)

    @property
    def cache_cols_per_pass(self) -> float:
        return sum(a.mask.shape[-1] - a.mask.shape[-2] for a in self.passes) / max(len(self.passes), 1)


def bucket_plans(plans: list[PassPlan], n_slots: int, widths: int, vis_step: int, dev, align: int = 1) -> StaticPlan:
    """Group PassPlans (all but the prefill) by (width class, cache prefix // vis_step) and pad each group to
    one shape; nothing here knows the schedule's rules. align: round each bucket's cache prefix up (its extra
    columns masked) so that its mask rows, n + W, are a whole number of `align` columns, as far as the cache
    reaches (N + 1 slots): `BIAS_ALIGN` for a bias the CUDA kernel reads without padding it."""
    N = n_slots
    allowed = no_lone_ones(pass_widths([len(p.src) for p in plans], widths))
    groups: dict[tuple[int, int], list[int]] = {}
    for s, p in enumerate(plans):
        width = next(w for w in allowed if w >= len(p.src))
        groups.setdefault((width, -(-p.n_vis // vis_step)), []).append(s)
    outs = no_lone_ones([max(max(plans[s].n_out for s in members), 1) for members in groups.values()])
    where = [None] * len(plans)
    buckets = []
    for ((W, _), members), O in zip(groups.items(), outs):
        n = min(-(-(max(plans[s].n_vis for s in members) + W) // align) * align - W, N + 1)
        P = len(members)
        b = Bucket(
            src=torch.zeros(P, W, dtype=torch.long, device=dev),
            coords=torch.ones(P, W, 4, dtype=torch.long, device=dev),
            mask=torch.zeros(P, 1, W, n + W, dtype=torch.bool, device=dev),
            cache_pos=torch.full((P, W), N, dtype=torch.long, device=dev),
            out_rows=torch.zeros(P, O, dtype=torch.long, device=dev),
            out_slots=torch.full((P, O), N, dtype=torch.long, device=dev),
        )
        b.mask[:, 0, torch.arange(W), n + torch.arange(W)] = True  # every row sees itself (padding: only that)
        for i, s in enumerate(members):
            p = plans[s]
            sq, nv = len(p.src), p.n_vis
            b.src[i, :sq], b.coords[i, :sq], b.cache_pos[i, :sq] = p.src, p.coords, p.cache_pos
            b.mask[i, 0, :sq, :nv] = p.mask[0, :, :nv]
            b.mask[i, 0, :sq, n:n + sq] = p.mask[0, :, nv:]
            b.out_rows[i, :p.n_out], b.out_slots[i, :p.n_out] = p.out_rows, p.out_slots
            where[s] = (len(buckets), i)
        buckets.append(b)
    return StaticPlan(buckets, [buckets[g].pass_inputs(i) for g, i in where], where,
                      real_rows=sum(len(p.src) for p in plans) / max(len(plans), 1),
                      real_cols=sum(p.n_vis for p in plans) / max(len(plans), 1))
