"""Post-training on the model's own rollouts (GRPO): the exact log-probability of a sampled rollout, and the loss.

`RolloutScorer`: by the parity property (docs/diagd.md sections 5-6) one forward pass over the schedule's input
sequence (proxy rows included) under the visibility rule gives, for every generated token, the logits the sampler
computed when it drew it; with the rolling window (section 7: every row sees frames >= its frame - context + 1)
this holds for rollouts longer than the trained clip. So the log-probability of a DiagD (or NTP) rollout, under
the distribution the sampler drew from (`token_logprobs`: temperature, top-k, top-p, image codes only), is one
teacher-forced pass, with gradients: exact policy gradients for the sampler users play with.

`group_advantages` and `grpo_loss` are GRPO (DeepSeekMath, 2024): G rollouts per start, each rollout's reward
normalised within its group, a clipped per-token importance ratio against the policy that sampled, and a KL
anchor to the starting model (the k3 estimator, unbiased and >= 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mcar.core.layout import Layout, check_clip
from mcar.core.sampler import SamplingRule, token_logprobs
from mcar.core.schedule import Schedule, ScheduleConfig


class RolloutScorer:
    """Clips of `frames` frames sampled on `config`'s schedule (a sampler's `config`: NTP is the raster schedule)
    with a rolling window of `context` frames (None: the whole clip) -> (B, N) log-probabilities of the generated
    tokens (0 elsewhere), in one forward pass of the model."""

    def __init__(self, layout: Layout, frames: int, config: ScheduleConfig, context: int | None = None,
                 full: bool = False):
        self.layout, self.frames = layout, frames
        s = self.schedule = Schedule.of(layout, frames, config)
        visible = s.table(full).dense()  # (S, S) the one rule
        if context is not None:  # the rolling cache's window (Schedule.plan(window=...) applies the same)
            frame = s.seq_pos // layout.frame_len
            visible &= (frame[None, :] > s.owner()[:, None] - context) | torch.eye(len(frame), dtype=torch.bool)
        self.mask = visible
        self.generated = s.gen_slots  # (n_gen,) layout slots of the generated tokens
        self.rows = s.predictor_row[s.gen_slots]  # (n_gen,) the input row whose output predicts each
        self._on: dict = {}

    def _device(self, device) -> dict:
        key = str(device)
        if key not in self._on:
            s = self.schedule
            self._on[key] = dict(src=s.seq_src.to(device), coords=s.seq_coords.to(device), mask=self.mask.to(device),
                                 rows=self.rows.to(device), generated=self.generated.to(device))
        return self._on[key]

    def __call__(self, model, clips: torch.Tensor, rule: SamplingRule) -> torch.Tensor:
        check_clip(clips, self.layout, self.frames)
        on = self._device(clips.device)
        logits = model(clips[:, on["src"]], on["coords"], on["mask"])[:, on["rows"]]  # (B, n_gen, V)
        out = torch.zeros(clips.shape, dtype=logits.dtype, device=clips.device)
        out[:, on["generated"]] = token_logprobs(logits, clips[:, on["generated"]], rule)
        return out

    def generated_mask(self, device=None) -> torch.Tensor:
        """(N,) bool: the slots the sampler generates."""
        mask = torch.zeros(self.layout.n_slots(self.frames), dtype=torch.bool)
        mask[self.generated] = True
        return mask.to(device)


def group_advantages(rewards: torch.Tensor, group: int, eps: float = 1e-4) -> torch.Tensor:
    """(B*G,) rewards, G consecutive rows per start -> (B*G,) advantages (r - group mean) / (group std + eps): a
    group whose rollouts all score alike teaches nothing (advantage 0)."""
    if rewards.dim() != 1 or len(rewards) % group:
        raise ValueError(f"rewards {tuple(rewards.shape)} are not whole groups of {group}")
    r = rewards.view(-1, group)
    std = r.std(1, keepdim=True, unbiased=False) if group > 1 else torch.zeros_like(r)
    return ((r - r.mean(1, keepdim=True)) / (std + eps)).flatten()


@dataclass
class GRPOStats:
    loss: torch.Tensor
    policy: torch.Tensor  # the clipped surrogate's term of the loss
    kl: torch.Tensor  # mean per-token KL estimate to the reference
    clip_fraction: torch.Tensor  # share of tokens whose ratio left [1 - eps, 1 + eps] on the side that clips
    ratio: torch.Tensor  # mean importance ratio


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float = 0.2, kl_coef: float = 0.04) -> GRPOStats:
    """GRPO's loss over (B, N) per-token log-probabilities: the policy being trained (`logp`, with gradients), the
    one that sampled (`old_logp`) and the reference (`ref_logp`, None: no KL term); `mask` (N,) or (B, N): the
    generated tokens. Each rollout's tokens are averaged, then the rollouts."""
    mask = mask.expand_as(logp).to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None].to(logp.dtype)
    unclipped, clipped = ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    surrogate = torch.minimum(unclipped, clipped)
    per_token = -surrogate
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1  # k3: unbiased for KL(policy || reference), never negative
        per_token = per_token + kl_coef * kl
    n = mask.sum(1).clamp(min=1)
    seq = lambda x: ((x * mask).sum(1) / n).mean()
    was_clipped = (clipped < unclipped).to(logp.dtype)
    return GRPOStats(loss=seq(per_token), policy=seq(-surrogate).detach(), kl=seq(kl).detach(),
                     clip_fraction=seq(was_clipped).detach(), ratio=seq(ratio).detach())
