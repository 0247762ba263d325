"""The ONE generation schedule: DiagD (docs/diagd.md sections 3-5), and NTP as its raster special case.

Generalised to P >= 1 prompt frames: image token c[t,i,j] of a generated frame t >= P is generated in pass

    G(t,i,j) = (t-P)*d + i*k + j              passes = (T-P-1)*d + s_spa,   s_spa = (h-1)*k + w

and every slot p has a feed pass F(p), the pass in which its key/value is computed and written:
prompt frames and their actions -> 0; generated image tokens -> G+1; actions a[t-1,.] of frame t > P -> (t-P)*d.
A generated token whose real predecessor is not fed by its generation pass (a row start when k < w; a frame
start when n_a = 0 and d < s_spa) is predicted by an ephemeral proxy input instead, at the predecessor's
position and coordinate. NTP is `Schedule.ntp` = k = w, d = h*w: no proxies, and the rule of section 5
becomes the causal mask.

The schedule is laid out as a sequence of S = N + n_px input rows: rows 0..N-1 are the N slots in layout
order (row p is slot p), rows N..S-1 the proxies in their targets' layout order. The visibility rule depends
only on each row's feed pass, position and proxy flag, so the row order is free; this one keeps flex-attention
tiles full or empty (the paper's clip: 18% of the computed 128x128 tiles partial, against 92% with each proxy
right after the slot it stands in for). The mask factory feeds that sequence in one pass; the samplers feed
the rows of pass s in forward pass s (`Schedule.plan`), in layout order within the pass. Nothing else
recomputes any of this.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace

import torch

from mcar.core.layout import Layout
from mcar.core.visibility import SlotTable

# row-start proxy content for target c[t,i,0]: prev_frame c[t-1,i,0] (the paper's section 3.2); above c[t,i-1,0]
# (appendix D.1; a frame start takes c[t-1,0,0]); prompt: the prompt frame's token at the predecessor's slot,
# c[0,i-1,w-1] (the public MineWorld code's, for comparison with it)
PROXIES = ("prev_frame", "above", "prompt")


@dataclass(frozen=True)
class ScheduleConfig:
    """The DiagD schedule one run uses everywhere: the training mask, validation, the dashboard and the samplers
    read it (conf/schedule/diagd.yaml holds these defaults; tests/test_schedule.py checks they agree).

    full: the diagd_full visibility (a query also sees later-position tokens fed in earlier passes); a model
    fine-tuned with it must be sampled with it."""

    k: int = 2  # how far the previous row must be ahead, >= 1
    d: int | None = None  # temporal delay in [1, s_spa]; None = s_spa (spatial-only)
    proxy: str = "prev_frame"  # one of PROXIES
    prompt_frames: int = 1  # P >= 1: frames P..T-1 are generated
    full: bool = False

    @classmethod
    def of(cls, cfg=None, **overrides) -> "ScheduleConfig":
        """From None, a ScheduleConfig, or a mapping (a `schedule` config group), plus keyword overrides."""
        base = cfg if isinstance(cfg, cls) else cls()
        given = {} if cfg is None or isinstance(cfg, cls) else dict(cfg)
        given |= {k: v for k, v in overrides.items() if v is not None or k == "d"}
        unknown = sorted(set(given) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"schedule has no field(s) {unknown}: its fields are k, d, proxy, prompt_frames, full")
        return replace(base, **given)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


@dataclass
class PassPlan:
    """What forward pass s feeds and samples; all tensors precomputed, on the sampler's device."""

    src: torch.Tensor  # (Sq,) long: slot whose token each input row carries (a proxy: its content source)
    coords: torch.Tensor  # (Sq, 4) long: RoPE coordinates of each input row
    cache_pos: torch.Tensor  # (Sq,) long: cache slot written after attending (proxies: the scratch slot N)
    mask: torch.Tensor  # (1, Sq, n_vis+Sq) bool: [cache slots 0..n_vis-1 | this pass's inputs]
    out_rows: torch.Tensor  # (n_out,) long: input rows whose output predicts a generated token
    out_slots: torch.Tensor  # (n_out,) long: the slot each of those outputs predicts
    out_index: torch.Tensor  # (n_out,) long: index of that slot in `Schedule.gen_slots`
    n_out: int
    n_vis: int  # 1 + the last cache slot any input of the pass sees (0: none); the scratch slot N never is
    index: int  # the pass number s


class Schedule:
    def __init__(self, layout: Layout, frames: int, prompt_frames: int = ScheduleConfig.prompt_frames,
                 k: int = ScheduleConfig.k, d: int | None = ScheduleConfig.d, proxy: str = ScheduleConfig.proxy):
        h, w = layout.h, layout.w
        _check(frames >= 2, f"frames={frames} is invalid: a clip needs >= 2 frames (a prompt and a target)")
        _check(prompt_frames >= 1, f"prompt_frames={prompt_frames} is invalid: it must be >= 1")
        _check(prompt_frames < frames,
               f"prompt_frames={prompt_frames} is invalid: it must be in [1, frames-1] = [1, {frames - 1}]")
        _check(k >= 1, f"k={k} is invalid: k must be >= 1")
        s_spa = (h - 1) * k + w
        d = s_spa if d is None else d
        _check(1 <= d <= s_spa, f"d={d} is invalid: d must be in [1, s_spa] = [1, {s_spa}] "
                                f"(s_spa = (h-1)*k + w for h={h}, w={w}, k={k}); null means s_spa")
        _check(proxy in PROXIES, f"proxy={proxy!r} is invalid: choose one of {', '.join(PROXIES)}")
        self.layout, self.frames, self.prompt_frames = layout, frames, prompt_frames
        self.k, self.d, self.proxy, self.s_spa = k, d, proxy, s_spa
        self.passes = (frames - prompt_frames - 1) * d + s_spa
        self.n_slots = layout.n_slots(frames)
        self._slots()
        self._proxies()
        self._sequence()
        self._plans: dict = {}

    @classmethod
    def of(cls, layout: Layout, frames: int, cfg: ScheduleConfig, prompt_frames: int | None = None) -> "Schedule":
        """The schedule of `cfg` (prompt_frames overrides cfg.prompt_frames); full is the table's, see table().
        One object per configuration in a process (read-only once built): the training mask, validation and every
        sampler of a run share it and its cached plans."""
        return _shared_schedule(cls, layout, frames, cfg.prompt_frames if prompt_frames is None else prompt_frames,
                                cfg.k, cfg.d, cfg.proxy)

    @classmethod
    def ntp(cls, layout: Layout, frames: int, prompt_frames: int = 1) -> "Schedule":
        """Raster order, one image token per pass: DiagD with k = w, d = s_spa = h*w (no proxies)."""
        return cls(layout, frames, prompt_frames, k=layout.w, d=layout.h * layout.w)

    # ---- per slot -------------------------------------------------------------------------------------
    def _slots(self):
        L, hw, w, P = self.layout.frame_len, self.layout.frame_tokens, self.layout.w, self.prompt_frames
        slot = torch.arange(self.n_slots)
        t, r = slot // L, slot % L
        is_img = r < hw
        self.generated = is_img & (t >= P)  # (N,) bool
        # (N,) long, -1 where not generated
        self.gen_pass = torch.where(self.generated, (t - P) * self.d + (r // w) * self.k + r % w, -1)
        self.feed_pass = torch.where(t < P, 0, torch.where(is_img, self.gen_pass + 1, (t + 1 - P) * self.d))
        self.coords = self.layout.coords(self.frames)  # (N, 4)
        self.gen_slots = slot[self.generated]  # (n_gen,) generated slots in layout order

    def _proxies(self):
        """A generated x gets a proxy iff its real predecessor x-1 is fed after x's generation pass."""
        L, w = self.layout.frame_len, self.layout.w
        x = self.gen_slots
        target = x[self.feed_pass[x - 1] > self.gen_pass[x]]  # (n_px,)
        row = (target % L) // w
        if self.proxy == "above":  # c[t,i-1,0]; a frame start (i = 0) has no row above: c[t-1,0,0]
            source = torch.where(row >= 1, target - w, target - L)
        elif self.proxy == "prompt":  # the predecessor's slot in frame 0 (a prompt frame: always there)
            source = (target - 1) % L
        else:  # prev_frame: c[t-1,i,0]
            source = target - L
        self.proxy_target, self.proxy_source, self.proxy_pred = target, source, target - 1
        self.proxy_pass = self.gen_pass[target]  # (n_px,) fed in the pass that generates its target
        # the content must be sampled before the proxy is fed (generated in an earlier pass, or a prompt token)
        src_gen = self.gen_pass[source]
        assert bool(((src_gen < 0) | (src_gen < self.proxy_pass)).all()), "proxy source not yet generated"

    # ---- the input sequence: real slots + proxies -----------------------------------------------------
    def _sequence(self):
        N, n_px = self.n_slots, len(self.proxy_target)
        slot = torch.arange(N)
        proxied = torch.zeros(N + 1, dtype=torch.bool)
        proxied[self.proxy_target] = True
        real_target = torch.where(proxied[1:], -1, slot + 1)  # the row start's real predecessor predicts nothing
        real_target[-1] = -1
        # real slots, then proxies (row N + i = proxy i): a proxy key between real ones, seen by its own query
        # only, would make every flex tile it falls in partial (see the module docstring)
        self.seq_pos = torch.cat([slot, self.proxy_pred])  # (S,) layout position of each row
        self.seq_src = torch.cat([slot, self.proxy_source])  # (S,) slot whose token the row carries
        self.seq_is_proxy = torch.cat([torch.zeros(N, dtype=torch.bool), torch.ones(n_px, dtype=torch.bool)])
        self.seq_feed_pass = torch.cat([self.feed_pass, self.proxy_pass])  # (S,)
        self.seq_target = torch.cat([real_target, self.proxy_target])  # (S,) slot predicted, -1 none
        self.seq_coords = self.coords[self.seq_pos]  # (S, 4): a proxy has its predecessor's coordinate
        rows = torch.arange(N + n_px)
        self.row_of_slot = rows[~self.seq_is_proxy]  # (N,) row of each real slot
        has = self.seq_target >= 0
        self.predictor_row = torch.full((N,), -1, dtype=torch.long)  # (N,) row predicting each slot
        self.predictor_row[self.seq_target[has]] = rows[has]
        # pass in which each generated token is sampled: its predictor's feed pass (< G only when k > w)
        self.out_pass = self.seq_feed_pass[self.predictor_row[self.gen_slots]]  # (n_gen,)

    def check_full(self) -> None:
        """The diagd_full visibility is only offered spatial-only (d = s_spa): with overlapping frames it lets a
        token of frame t see a[t] (the action after frame t; the last frame sees a[T-1]), and with action_loss the
        last image token see its own action target."""
        _check(self.d == self.s_spa, f"schedule.full=true needs d = s_spa = {self.s_spa} (null), got d={self.d}: "
                                     f"with overlapping frames full visibility shows frame t the action a[t]")

    def table(self, full: bool = False, device=None) -> SlotTable:
        """The sequence's visibility table (docs/diagd.md section 5); `full` = the diagd_full variant."""
        return SlotTable(self.seq_feed_pass.to(device), self.seq_pos.to(device), self.seq_is_proxy.to(device),
                         full)

    # ---- per pass, for the samplers -------------------------------------------------------------------
    def owner(self) -> torch.Tensor:
        """(S,) long: the frame each row works for (docs/diagd.md section 7): an image token's or a proxy's target
        frame; an action a[t-1,.] the frame t it starts."""
        L, hw = self.layout.frame_len, self.layout.frame_tokens
        real = self.seq_pos // L + (self.seq_pos % L >= hw).long()
        return torch.where(self.seq_is_proxy, self.seq_target // L, real)

    def plan(self, full: bool = False, device=None, window: int | None = None) -> list[PassPlan]:
        """One PassPlan per non-empty pass (a pass is empty only when k > w), cached per (full, device, window).
        window: a row working for frame u sees only frames >= u - window + 1 (the rolling cache's rule, section 7);
        None: the whole clip."""
        key = (full, str(device), window)
        if key not in self._plans:
            self._plans[key] = list(self._build_plan(full, device, window))
        return self._plans[key]

    def _build_plan(self, full, device, window):
        N, F = self.n_slots, self.seq_feed_pass
        counts = torch.bincount(F, minlength=self.passes + 1)[: self.passes]
        # grouped by pass; within a pass in layout order, a proxy right after its predecessor's slot: the order
        # the sampler always fed (its matmuls, and so its logits, do not depend on the training sequence order)
        order = (F * 2 * N + 2 * self.seq_pos + self.seq_is_proxy.long()).argsort()
        rows = order[: int(counts.sum())]  # (R,) the rows the sampler feeds
        visible = self.table(full).dense()[rows]  # (R, S): the one rule, evaluated once
        if window is not None:
            frame = self.seq_pos // self.layout.frame_len  # (S,) the frame whose slot a key row is
            visible &= frame[None, :] > self.owner()[rows, None] - window
        written = self.feed_pass[None, :] < F[rows, None]  # (R, N) cache slots written by earlier passes
        cache = visible[:, self.row_of_slot] & written  # (R, N): cache column c holds slot c
        reach = torch.where(cache, torch.arange(1, N + 1), 0).amax(1)  # (R,) 1 + last cache column seen
        cache = cache.to(device)
        own = visible[:, rows].to(device)  # (R, R): a pass's own inputs are a diagonal block
        target = self.seq_target[rows]
        out = (target >= 0) & self.generated[target.clamp(min=0)]  # (R,) output predicts a generated token
        gen_index = torch.full((N,), -1, dtype=torch.long)
        gen_index[self.gen_slots] = torch.arange(len(self.gen_slots))
        src, coords = self.seq_src[rows].to(device), self.seq_coords[rows].to(device)
        cache_pos = torch.where(self.seq_is_proxy[rows], N, self.seq_pos[rows]).to(device)  # proxies: scratch N
        ends = counts.cumsum(0).tolist()
        for a, b in zip([0] + ends[:-1], ends):
            if a == b:
                continue
            out_rows = out[a:b].nonzero().squeeze(1)
            out_slots = target[a:b][out_rows]
            n_vis = int(reach[a:b].max())
            yield PassPlan(
                src=src[a:b], coords=coords[a:b], cache_pos=cache_pos[a:b],
                mask=torch.cat([cache[a:b, :n_vis], own[a:b, a:b]], dim=1)[None],  # (1, Sq, n_vis+Sq)
                out_rows=out_rows.to(device), out_slots=out_slots.to(device),
                out_index=gen_index[out_slots].to(device), n_out=len(out_rows), n_vis=n_vis, index=int(F[rows[a]]),
            )


@functools.lru_cache(maxsize=64)
def _shared_schedule(cls, layout: Layout, frames: int, prompt_frames: int, k: int, d: int | None,
                     proxy: str) -> Schedule:
    return cls(layout, frames, prompt_frames, k, d, proxy)
