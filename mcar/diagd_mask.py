"""DiagD fine-tuning masks (../shared/DIAGD.md section 5): `diagd` and `diagd_full`.

One parallel pass over the schedule's input sequence (every slot, plus one proxy row per proxied target)
computes, for every generated token, exactly the logits the DiagD sampler computes for it (the parity
property, tests/test_parity.py). Everything comes from `mcar.schedule.Schedule`.

`proxy_slots=False` is the paper's plain variant: the input is the plain clip (no extra rows), each slot p
is fed in the schedule's pass F(p), the mask is the same visibility rule over those F, and the targets are
plain next-token targets, so a row start is predicted by its real predecessor c[t,i-1,w-1] (which DiagD
sampling replaces by a proxy): not parity-exact with the sampler when k < w, for comparison only.
"""
from __future__ import annotations

import torch

from mcar.layout import Layout
from mcar.masks import IGNORE, CausalMask, MaskedBatch, SlotTable, check_clip, next_token_targets, resolve_backend
from mcar.schedule import Schedule


class DiagDMask(CausalMask):
    name = "diagd"
    full = False
    plain_causal = False  # its own table: a dense mask on SDPA

    def __init__(self, layout: Layout, frames: int, k: int = 2, d: int | None = None, proxy: str = "prev_frame",
                 proxy_slots: bool = True, action_loss: bool = False, backend: str = "auto",
                 prompt_frames: int = 1):
        resolve_backend(backend, torch.device("cpu"))  # fail at config time on a bad backend
        super().__init__(layout, frames, action_loss, backend)
        self.schedule = s = Schedule(layout, frames, prompt_frames, k, d, proxy)
        self.proxy_slots = proxy_slots
        if proxy_slots:
            self.src, self.coords, self.target_slot = s.seq_src, s.seq_coords, s.seq_target  # (S,), (S,3), (S,)
        else:
            slot = torch.arange(s.n_slots)
            self.src, self.target_slot = slot, torch.where(slot + 1 < s.n_slots, slot + 1, -1)
        # (N,) which input row predicts each layout slot; -1 where none does
        self.predictor_row = s.predictor_row if proxy_slots else torch.arange(s.n_slots) - 1

    def table(self, device=None) -> SlotTable:
        s = self.schedule
        if self.proxy_slots:
            return s.table(self.full, device)
        return SlotTable(s.feed_pass.to(device), torch.arange(s.n_slots, device=device),
                         torch.zeros(s.n_slots, dtype=torch.bool, device=device), self.full)

    def __call__(self, clip: torch.Tensor) -> MaskedBatch:
        """clip (B, N) long -> inputs (B, S), coords (S, 3), targets (B, S), mask over the S input rows."""
        check_clip(clip, self.layout, self.frames)
        dev = clip.device
        if self.proxy_slots:
            target = self.target_slot.to(dev)  # (S,)
            keep = target >= 0
            if not self.action_loss:
                keep &= self.layout.is_image(self.frames).to(dev)[target.clamp(min=0)]
            targets = torch.where(keep, clip[:, target.clamp(min=0)], IGNORE)  # (B, S)
        else:
            targets = next_token_targets(clip, self.layout, self.frames, self.action_loss)
        return MaskedBatch(tokens=clip[:, self.src.to(dev)], coords=self.coords.to(dev), targets=targets,
                           mask=self._mask(dev))


class DiagDFullMask(DiagDMask):
    """Also lets a query see later-position tokens fed in earlier passes; sample only a model tuned with it."""

    name = "diagd_full"
    full = True


FACTORIES = {"diagd": DiagDMask, "diagd_full": DiagDFullMask}
