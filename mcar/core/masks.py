"""Mask factories: a batch of clips -> model inputs, RoPE coordinates, loss targets and the attention mask.

`causal` (pre-training) is the plain causal mask over the flat clip. `diagd` (fine-tuning, docs/diagd.md
section 5) feeds the schedule's input sequence (every slot, plus one proxy row per proxied target) under the
visibility rule of `mcar.core.visibility`, so that one parallel pass computes, for every generated token, exactly
the logits the DiagD sampler computes for it (the parity property, tests/test_parity.py). `diagd_full` is
`diagd` with `schedule.full`. Everything DiagD comes from `mcar.core.schedule.Schedule`.

`proxy_slots=False` is the paper's plain variant: the input is the plain clip (no extra rows), each slot p is fed
in the schedule's pass F(p), the mask is the same visibility rule over those F, and the targets are plain
next-token targets, so a row start is predicted by its real predecessor c[t,i-1,w-1] (which DiagD sampling
replaces by a proxy): not parity-exact with the sampler when k < w, for comparison only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from mcar.core.layout import Layout, check_clip
from mcar.core.schedule import Schedule, ScheduleConfig
from mcar.core.visibility import SlotTable, causal_table

IGNORE = -100  # loss target of slots that carry no loss (F.cross_entropy's ignore_index)
BACKENDS = ("auto", "sdpa", "flex")


@dataclass
class MaskedBatch:
    tokens: torch.Tensor  # (B, S) long model inputs
    coords: torch.Tensor  # (S, 4) long RoPE coordinates (Layout.coords)
    targets: torch.Tensor  # (B, S) long, IGNORE where no loss
    mask: torch.Tensor | BlockMask | None  # dense (S, S) bool, BlockMask, or None: plain causal (SDPA is_causal)


class MaskFactory(Protocol):
    """What training, validation and the tests use of a mask factory."""

    name: str
    layout: Layout
    frames: int

    def table(self, device=None) -> SlotTable:
        """The visibility table of the input sequence (S rows)."""

    def __call__(self, clip: torch.Tensor) -> MaskedBatch:
        """clip (B, N) long, N = frames * frame_len -> the model's inputs, coordinates, targets and mask."""

    def target_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """(B, N) a weight per clip slot -> (B, S) each input row's: the weight of the slot its target is read from
        (a row with no target carries no loss, whatever it gets)."""


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"mask.backend must be one of {'|'.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return backend


def attention_path(backend: str, device: torch.device, plain_causal: bool) -> str:
    """How a mask reaches attention: `is_causal` (SDPA's flag: flash / cuDNN attention on a GPU, faster than
    Triton flex at head_dim 64, and the fused CPU kernel), `flex` (a BlockMask) or `dense` (a bool mask for SDPA).
    The plain causal mask takes is_causal unless flex is asked for by name."""
    resolved = resolve_backend(backend, device)
    if plain_causal and (backend == "auto" or resolved == "sdpa"):
        return "is_causal"
    return "flex" if resolved == "flex" else "dense"


def masked_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The training loss: mean cross-entropy over slots whose target is not IGNORE. logits (B, S, V), targets (B, S)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def weighted_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """masked_loss with a weight per slot (B, S): the weighted mean cross-entropy over slots whose target is not
    IGNORE (all weights 1: masked_loss)."""
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none")
    w = weights.flatten().to(ce.dtype) * (targets.flatten() != IGNORE)
    return (ce * w).sum() / w.sum()


def far_copy_slots(clip: torch.Tensor, layout: Layout, frames: int, near: int = 2) -> torch.Tensor:
    """(B, N) clip -> (B, N) bool: the image tokens that differ from the same place in each of the `near` frames
    before but equal it in an earlier frame of the clip: what a view that comes back after a wait or a longer walk
    shows, which no copy from the last `near` frames gives (action slots: False)."""
    B, ft = clip.shape[0], layout.frame_tokens
    img = clip.view(B, frames, layout.frame_len)[..., :ft]
    out = torch.zeros(B, frames, layout.frame_len, dtype=torch.bool, device=clip.device)
    for t in range(near + 1, frames):
        new = torch.stack([img[:, t] != img[:, t - j] for j in range(1, near + 1)]).all(0)
        seen = torch.stack([img[:, t] == img[:, j] for j in range(t - near)]).any(0)
        out[:, t, :ft] = new & seen
    return out.view(B, -1)


def next_token_keep(layout: Layout, frames: int, action_loss: bool) -> torch.Tensor:
    """(N,) bool: slot p carries a loss (its target, slot p+1, is an image token, or any token if action_loss)."""
    keep = layout.is_image(frames)
    if action_loss:
        keep = torch.ones_like(keep)
    return torch.cat([keep[1:], keep.new_zeros(1)])  # the target slot is p+1


def next_token_targets(clip: torch.Tensor, layout: Layout, frames: int, action_loss: bool) -> torch.Tensor:
    """(B, N) clip -> (B, N) targets: slot p predicts clip[p+1]; only image tokens (and actions if asked)."""
    return shifted_targets(clip, next_token_keep(layout, frames, action_loss).to(clip.device))


def shifted_targets(clip: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B, N) clip -> (B, N) targets: slot p predicts clip[p+1] where keep[p] (next_token_keep on clip's device)."""
    targets = torch.full_like(clip, IGNORE)
    targets[:, :-1] = clip[:, 1:]
    return torch.where(keep, targets, IGNORE)


class _DeviceCopies:
    """A factory's constant CPU tensors, copied to each device once: a step then makes no host-to-device copy (a
    copy from pageable memory waits for the GPU, a host sync per step)."""

    def __init__(self, **tensors: torch.Tensor):
        self.cpu = tensors
        self._copies: dict[str, dict[str, torch.Tensor]] = {}

    def __call__(self, device: torch.device) -> dict[str, torch.Tensor]:
        key = str(device)
        if key not in self._copies:
            self._copies[key] = {name: t.to(device) for name, t in self.cpu.items()}
        return self._copies[key]


class _DeviceMasks:
    """The mask of one table per device, built once (a BlockMask on flex, a dense bool tensor on SDPA)."""

    def __init__(self, table, backend: str, plain_causal: bool):
        resolve_backend(backend, torch.device("cpu"))  # fail at config time on a bad backend
        self.table, self.backend, self.plain_causal = table, backend, plain_causal
        self._masks: dict[str, torch.Tensor | BlockMask | None] = {}

    def __call__(self, device: torch.device):
        key = str(device)
        if key not in self._masks:
            path = attention_path(self.backend, device, self.plain_causal)
            if path == "flex":
                self._masks[key] = self.table(device).block_mask()
            else:  # the dense mask is built on the host: its rule reads per-row codes made there
                self._masks[key] = None if path == "is_causal" else self.table().dense().to(device)
        return self._masks[key]


class CausalMask:
    """Pre-training: the plain causal mask over the flat clip."""

    name = "causal"

    def __init__(self, layout: Layout, frames: int, action_loss: bool = False, backend: str = "auto"):
        self.layout, self.frames, self.action_loss = layout, frames, action_loss
        self.coords = layout.coords(frames)
        self._mask = _DeviceMasks(self.table, backend, plain_causal=True)
        n = layout.n_slots(frames)
        self._on = _DeviceCopies(coords=self.coords, keep=next_token_keep(layout, frames, action_loss),
                                 gather=(torch.arange(n) + 1).clamp(max=n - 1))  # slot p predicts slot p + 1

    def table(self, device=None) -> SlotTable:
        return causal_table(self.layout.n_slots(self.frames), device)

    def target_weights(self, weights: torch.Tensor) -> torch.Tensor:
        return weights[:, self._on(weights.device)["gather"]]

    def __call__(self, clip: torch.Tensor) -> MaskedBatch:
        check_clip(clip, self.layout, self.frames)
        on = self._on(clip.device)
        return MaskedBatch(tokens=clip, coords=on["coords"], targets=shifted_targets(clip, on["keep"]),
                           mask=self._mask(clip.device))


class DiagDMask:
    """DiagD fine-tuning on `schedule` (a ScheduleConfig, or its fields as keywords)."""

    def __init__(self, layout: Layout, frames: int, schedule: ScheduleConfig | dict | None = None,
                 proxy_slots: bool = True, action_loss: bool = False, backend: str = "auto",
                 generated_only: bool = False, **schedule_fields):
        """generated_only: a loss only on the image tokens the sampler generates (frames >= prompt_frames), so the
        mean loss is the teacher-forced sampler's (validation); else on every image token (and action)."""
        self.layout, self.frames, self.action_loss, self.proxy_slots = layout, frames, action_loss, proxy_slots
        self.generated_only = generated_only
        if generated_only and action_loss:
            raise ValueError("generated_only=true scores generated image tokens only: it excludes action_loss=true")
        self.config = cfg = ScheduleConfig.of(schedule, **schedule_fields)
        self.full = cfg.full
        self.name = "diagd_full" if cfg.full else "diagd"
        self.schedule = s = Schedule.of(layout, frames, cfg)
        if cfg.full:
            s.check_full()
            # plain rows + full visibility: a row start's predictor c[t,i-1,w-1] is fed after c[t,i,0] and sees
            # it (its own target) whenever the next row runs ahead of it, i.e. k <= w - 2
            if not proxy_slots and cfg.k <= layout.w - 2:
                raise ValueError(f"mask.proxy_slots=false with schedule.full=true and k={cfg.k} <= w-2={layout.w - 2}"
                                 f" shows each row start's predictor its own target: use proxy_slots=true")
        if proxy_slots:
            self.src, self.coords, self.target_slot = s.seq_src, s.seq_coords, s.seq_target  # (S,), (S,3), (S,)
        else:
            slot = torch.arange(s.n_slots)
            self.src, self.coords = slot, s.coords
            self.target_slot = torch.where(slot + 1 < s.n_slots, slot + 1, -1)
        # (N,) which input row predicts each layout slot; -1 where none does
        self.predictor_row = s.predictor_row if proxy_slots else torch.arange(s.n_slots) - 1
        self._mask = _DeviceMasks(self.table, backend, plain_causal=False)
        gather = self.target_slot.clamp(min=0)  # (S,) the slot each row's target is read from
        keep = self.target_slot >= 0  # (S,) rows that carry a loss
        if generated_only:
            keep &= s.generated[gather]
        elif not action_loss:
            keep &= layout.is_image(frames)[gather]
        self._on = _DeviceCopies(src=self.src, coords=self.coords, gather=gather, keep=keep)

    def target_weights(self, weights: torch.Tensor) -> torch.Tensor:
        return weights[:, self._on(weights.device)["gather"]]

    def table(self, device=None) -> SlotTable:
        s = self.schedule
        if self.proxy_slots:
            return s.table(self.full, device)
        return SlotTable(s.feed_pass.to(device), torch.arange(s.n_slots, device=device),
                         torch.zeros(s.n_slots, dtype=torch.bool, device=device), self.full)

    def __call__(self, clip: torch.Tensor) -> MaskedBatch:
        """clip (B, N) long -> inputs (B, S), coords (S, 4), targets (B, S), mask over the S input rows."""
        check_clip(clip, self.layout, self.frames)
        on = self._on(clip.device)
        targets = torch.where(on["keep"], clip[:, on["gather"]], IGNORE)  # (B, S)
        return MaskedBatch(tokens=clip[:, on["src"]], coords=on["coords"], targets=targets,
                           mask=self._mask(clip.device))


def build_mask_factory(name: str, layout: Layout, frames: int, schedule: ScheduleConfig | dict | None = None,
                       **kwargs) -> MaskFactory:
    """mask=<name> from the config (+ the run's schedule for DiagD) -> a mask factory. `diagd_full` is `diagd`
    with schedule.full=true."""
    if name == "causal":
        return CausalMask(layout, frames, **kwargs)
    if name in ("diagd", "diagd_full"):
        return DiagDMask(layout, frames, schedule, **kwargs, **({"full": True} if name == "diagd_full" else {}))
    raise ValueError(f"mask.name={name!r} is unknown; choose one of causal, diagd, diagd_full")
