"""The schedule of an open-ended rollout on a rolling KV cache (docs/diagd.md section 7).

A row working for frame u (`Schedule.owner`) sees only frames >= u - context + 1, so the cache needs the last
`ring = context + in_flight - 1` frames, in_flight = ceil(s_spa / d) frames being decoded at once: frame f's slots
are ring column (f mod ring) * L + offset, and a new frame writes over the slots of the frame `ring` before it,
which no row in flight sees any more. Time coordinates keep increasing (RoPE is relative in q.k).

The passes come in advances of d passes (advance a starts frame P + a with the action a[P+a-1]). They are taken
from one `Schedule` of `first_steady + 1` frames under the window rule, mapped to ring columns: advances before
`first_steady - P` as they are (the warm-up, the prefill in pass 0), and after that the d passes of advance
`first_steady - P` repeat with every frame index shifted by one per advance (`shifted`). Nothing per frame is
rebuilt; a pass is a few gathers of its template.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from mcar.core.buckets import bucket_plans
from mcar.core.layout import Layout
from mcar.core.model import padded_attention_bias
from mcar.core.schedule import PassPlan, Schedule, ScheduleConfig


class RollingPass(NamedTuple):
    """One pass on the ring: token columns and cache slots are ring columns (the scratch / dummy column is ring*L)."""

    src: torch.Tensor  # (W,) long: token column of each input row
    coords: torch.Tensor  # (W, 4) long: RoPE coordinates
    mask: torch.Tensor  # (1, W, ring*L + W) bool: [ring columns | this pass's inputs]
    cache_pos: torch.Tensor  # (W,) long: ring column written (proxies, padding: the scratch column)
    out_rows: torch.Tensor  # (O,) long: rows sampled
    out_slots: torch.Tensor  # (O,) long: token column each output is written to (padding: the dummy column)
    out_abs: torch.Tensor  # (O,) long: the slot in the open-ended clip each output predicts (keys its noise)


class RollingSchedule:
    """The passes of every advance on a ring of `ring` frames: `prefill`, then `passes(a)` for advance a."""

    def __init__(self, layout: Layout, config: ScheduleConfig, context: int, full: bool = False,
                 device=None, static_widths: int | None = None):
        """static_widths: pad the passes after the prefill to at most that many row counts (mcar.core.buckets);
        None: unpadded (eager)."""
        P, L = config.prompt_frames, layout.frame_len
        if context < 2 or P >= context:
            raise ValueError(f"sampler.context={context} is invalid: a rolling window needs >= 2 frames and more "
                             f"than the {P} prompt frame(s)")
        s_spa = (layout.h - 1) * config.k + layout.w
        d = s_spa if config.d is None else config.d
        self.layout, self.context, self.prompt_frames, self.d = layout, context, P, d
        self.in_flight = -(-s_spa // d)
        self.ring = context + self.in_flight - 1
        # the first frame u whose advance only holds rows whose windows start after the prompt: from there on, every
        # advance is this one shifted by whole frames
        self.first_steady = P + context - 1 + s_spa // d
        self.n_cols = self.ring * L  # ring columns; column n_cols is the scratch slot / dummy token column
        # proxy=prompt reads frame 0 for ever: the token columns after the dummy keep a copy of it
        self.pinned = self.n_cols + 1 if config.proxy == "prompt" else None
        self.n_token_cols = self.n_cols + 1 + (L if self.pinned else 0)
        ref = Schedule(layout, self.first_steady + 1, P, config.k, d, config.proxy)
        plans = [p for p in ref.plan(full, "cpu", window=context) if p.index < (self.first_steady - P + 1) * d]
        self.ref_slots = ref.n_slots
        col = torch.arange(self.n_token_cols)
        # _rot[j]: ring column of frame f -> the same offset in frame f + j; the scratch column and pinned ones stay
        self._rot = torch.stack([torch.where(col < self.n_cols, (col // L + j) % self.ring * L + col % L, col)
                                 for j in range(self.ring)]).to(device)
        ring_plans = [self._to_ring(p) for p in plans]
        self.prefill = self._rolling_pass(ring_plans[0], plans[0].out_slots, device)
        rest, rest_abs = ring_plans[1:], [p.out_slots for p in plans[1:]]
        if static_widths is None:
            passes = [self._rolling_pass(p, a, device) for p, a in zip(rest, rest_abs)]
        else:
            st = bucket_plans(rest, self.n_cols, static_widths, self.n_cols, device)
            passes = [RollingPass(*inp, out_abs=_padded(a, len(inp.out_slots)).to(device))
                      for inp, a in zip(st.passes, rest_abs)]
        steady_from = (self.first_steady - P) * d
        self.warmup = [[] for _ in range(self.first_steady - P)]  # per advance, its passes after the prefill
        self.period: list[RollingPass] = []  # the passes of advance first_steady - P, templates of every later one
        for p, r in zip(plans[1:], passes):
            (self.period if p.index >= steady_from else self.warmup[p.index // d]).append(r)

    def _to_ring(self, p: PassPlan) -> PassPlan:
        """A pass of the reference clip with its slots mapped to ring columns (mask width: the whole ring)."""
        n, at = self.n_cols, self._ring_column
        Sq = len(p.src)
        mask = torch.zeros(1, Sq, n + Sq, dtype=torch.bool)
        q, c = p.mask[0, :, :p.n_vis].nonzero(as_tuple=True)
        mask[0, q, at(c)] = True  # the visible slots span at most `ring` frames: no two share a column
        mask[0, :, n:] = p.mask[0, :, p.n_vis:]
        src = at(p.src)
        if self.pinned is not None:  # a proxy (it writes the scratch slot) reads the pinned copy of frame 0
            src = torch.where(p.cache_pos >= self.ref_slots, self.pinned + p.src, src)
        return PassPlan(src=src, coords=p.coords, cache_pos=at(p.cache_pos), mask=mask, out_rows=p.out_rows,
                        out_slots=at(p.out_slots), out_index=p.out_index, n_out=p.n_out, n_vis=n, index=p.index)

    def _ring_column(self, slot: torch.Tensor) -> torch.Tensor:
        """Slots of the reference clip -> ring columns; its scratch slot -> the ring's."""
        L = self.layout.frame_len
        return torch.where(slot >= self.ref_slots, self.n_cols, slot // L % self.ring * L + slot % L)

    @staticmethod
    def _rolling_pass(p: PassPlan, out_abs: torch.Tensor, device) -> RollingPass:
        return RollingPass(p.src.to(device), p.coords.to(device), p.mask.to(device), p.cache_pos.to(device),
                           p.out_rows.to(device), p.out_slots.to(device), out_abs.to(device))

    def passes(self, advance: int) -> list[RollingPass]:
        """The passes of advance `advance` after its prefill (advance 0's prefill is `self.prefill`)."""
        if advance < len(self.warmup):
            return self.warmup[advance]
        j = advance - len(self.warmup)
        return [self.shifted(p, j) for p in self.period]

    def shifted(self, p: RollingPass, j: int) -> RollingPass:
        """Template pass `p` moved j frames on: ring columns rotated, time coordinates (and flat positions) + j."""
        L, n = self.layout.frame_len, self.n_cols
        rot, back = self._rot[j % self.ring], self._rot[-j % self.ring]
        mask = torch.cat([p.mask[..., back[:n]], p.mask[..., n:]], -1)  # new column rot(c) shows old column c
        step = torch.tensor([j, 0, 0, j * L], device=p.coords.device)
        return RollingPass(rot[p.src], p.coords + step, mask, rot[p.cache_pos], p.out_rows, rot[p.out_slots],
                           p.out_abs + j * L)

    @property
    def cache_slots(self) -> int:
        """KV cache slots a rollout on this ring needs: the ring's columns and the scratch slot."""
        return self.n_cols + 1

    def column(self, frame: int) -> int:
        """Ring column of frame `frame`'s first slot."""
        return frame % self.ring * self.layout.frame_len

    def staged(self, groups: int, dtype) -> "StagedRolling":
        """The passes as a compiled step reads them (`StagedRolling`), for a model of `groups` query heads per KV
        head computing its cache in `dtype`; built once per (groups, dtype)."""
        if not hasattr(self, "_staged"):
            self._staged: dict = {}
        if (groups, dtype) not in self._staged:
            self._staged[groups, dtype] = StagedRolling(self, groups, dtype)
        return self._staged[groups, dtype]


class StagedRolling:
    """Every pass after the prefill as the compiled step reads it: one set of input tensors per pass shape, at fixed
    addresses (marked static for CUDA graphs), the mask already the attention bias. `passes(a)` fills them for
    advance a from templates built once on the device, a few gathers and adds per pass with the frame shift as a
    kernel argument: no host-to-device copy, no host sync, nothing built per frame (`RollingSchedule.shifted`
    builds a shift vector on the host for every pass). CUDA graphs copy a graph input that is not static at every
    replay; a bias built inside the graph is built again per attention call."""

    def __init__(self, plan: RollingSchedule, groups: int, dtype):
        self.plan, L, n = plan, plan.layout.frame_len, plan.n_cols
        device = plan.prefill.src.device
        self._step = torch.tensor([1, 0, 0, L], device=device)  # one frame on: time + 1, flat position + L
        self._templates: dict[int, tuple] = {}  # id(pass) -> (its bias, the shape its buffers are keyed by)
        self._buffers: dict[tuple, RollingPass] = {}  # shape -> the inputs at fixed addresses
        self._columns: dict[tuple, torch.Tensor] = {}  # (phase, bias width, S) -> bias column order of that phase
        for p in [q for adv in plan.warmup for q in adv] + plan.period:
            # (1, 1, g*S, n+S): [own inputs | ring columns], as cached_attention_bias makes it per forward
            bias = padded_attention_bias(p.mask, groups, dtype)[..., :p.mask.shape[-1]].contiguous()
            shape = (len(p.src), len(p.out_rows), bias.shape[-1])
            self._templates[id(p)] = (bias, shape)
            if shape not in self._buffers:
                buf = RollingPass(*(torch.empty_like(t) for t in p[:2]), torch.empty_like(bias), *(
                    torch.empty_like(t) for t in p[3:]))
                for t in buf:
                    torch._dynamo.mark_static_address(t, guard=False)
                self._buffers[shape] = buf
        self._n = n

    def _bias_columns(self, phase: int, width: int, S: int) -> torch.Tensor:
        """The bias's columns for ring phase `phase`: own inputs, then ring column c shows the template's column
        back(c)."""
        key = (phase, width, S)
        if key not in self._columns:
            back = self.plan._rot[-phase % self.plan.ring][:self._n]
            cols = torch.arange(width, device=back.device)
            cols[S:S + self._n] = S + back
            self._columns[key] = cols
        return self._columns[key]

    def load(self, p: RollingPass, j: int) -> RollingPass:
        """Template `p` moved j frames on (`RollingSchedule.shifted`), in its shape's fixed-address inputs."""
        bias, shape = self._templates[id(p)]
        buf = self._buffers[shape]
        rot = self.plan._rot[j % self.plan.ring]
        for name in ("src", "cache_pos", "out_slots"):
            torch.index_select(rot, 0, getattr(p, name), out=getattr(buf, name))
        torch.add(p.coords, self._step, alpha=j, out=buf.coords)
        torch.add(p.out_abs, j * self.plan.layout.frame_len, out=buf.out_abs)
        buf.out_rows.copy_(p.out_rows)
        torch.index_select(bias, -1, self._bias_columns(j % self.plan.ring, bias.shape[-1], len(p.src)),
                           out=buf.mask)
        return buf

    def passes(self, advance: int):
        """The inputs of each pass of `advance` after its prefill, in order (one buffer per shape: run each pass
        before taking the next)."""
        plan = self.plan
        if advance < len(plan.warmup):
            for p in plan.warmup[advance]:
                yield self.load(p, 0)
            return
        j = advance - len(plan.warmup)
        for p in plan.period:
            yield self.load(p, j)


def _padded(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(n - len(x))])
