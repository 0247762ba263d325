"""NTP and DiagD samplers on the model's static KV cache (plain torch, gpt-fast style).

One forward pass per schedule pass: pass s feeds exactly the rows the schedule feeds in pass s (real slots
with F = s, written to their cache slot after attending; proxies, written to a scratch slot no mask shows)
under the visibility rule of DIAGD.md section 5, and samples every output that predicts a generated token.
All per-pass tensors come precomputed from `Schedule.plan`; the loop only gathers, runs the model and samples
on device (no host syncs). A teacher-forced mode takes the clip's tokens instead of sampling and returns the
logits of every generated token: the parity test and the DiagD validation loss use it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mcar.layout import Layout
from mcar.masks import check_clip
from mcar.schedule import Schedule


@dataclass
class SampleStats:
    passes: int  # forward passes run
    tokens: int  # image tokens generated, over the whole batch
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


@dataclass
class TeacherForced:
    slots: torch.Tensor  # (n_gen,) long: the generated slots, in layout order
    nll: torch.Tensor  # (B, n_gen) float32: cross-entropy of each generated token
    logits: torch.Tensor | None  # (B, n_gen, V) float32, when asked for


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (..., V) -> token ids (...). temperature 0 or top_k 1 is greedy."""
    if temperature <= 0 or top_k == 1:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    # exponential race = multinomial sampling without a host sync (gpt-fast)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(-1)


class DiagDSampler:
    name = "diagd"

    def __init__(self, layout: Layout, frames: int, prompt_frames: int = 1, k: int = 2, d: int | None = None,
                 proxy: str = "prev_frame", full: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None):
        if temperature < 0:
            raise ValueError(f"temperature={temperature} is invalid: it must be >= 0 (0 = greedy)")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k} is invalid: it must be >= 1 or null (off)")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p} is invalid: it must be in (0, 1] or null (off)")
        self.layout, self.frames, self.full = layout, frames, full
        self.schedule_args = dict(k=k, d=d, proxy=proxy)
        self.prompt_frames = prompt_frames
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
        self._schedules: dict[int, Schedule] = {}
        self.schedule(prompt_frames)  # validate now, at config time

    def schedule(self, prompt_frames: int | None = None) -> Schedule:
        P = self.prompt_frames if prompt_frames is None else prompt_frames
        if P not in self._schedules:
            self._schedules[P] = Schedule(self.layout, self.frames, P, **self.schedule_args)
        return self._schedules[P]

    @torch.no_grad()
    def generate(self, model, clip: torch.Tensor, prompt_frames: int | None = None,
                 setup_cache: bool = True) -> tuple[torch.Tensor, SampleStats]:
        """clip (B, N): prompt frames + every action (other image tokens are ignored) -> (B, N) filled in."""
        sched = self.schedule(prompt_frames)
        gen = None
        if self.seed is not None:
            gen = torch.Generator(clip.device).manual_seed(self.seed)
        t0 = time.perf_counter()
        tokens = clip.clone()
        passes = 0
        for p, logits in self._passes(model, tokens, sched, setup_cache):
            passes += 1
            if p.n_out:
                tokens[:, p.out_slots] = sample(logits[:, p.out_rows], self.temperature, self.top_k, self.top_p, gen)
        if tokens.is_cuda:
            torch.cuda.synchronize(tokens.device)
        return tokens, SampleStats(passes, tokens.shape[0] * len(sched.gen_slots), time.perf_counter() - t0)

    @torch.no_grad()
    def teacher_forced(self, model, clip: torch.Tensor, prompt_frames: int | None = None,
                       setup_cache: bool = True, keep_logits: bool = True) -> TeacherForced:
        """Feed the clip's own tokens on the sampler's schedule; score every generated token."""
        sched = self.schedule(prompt_frames)
        B, n_gen = clip.shape[0], len(sched.gen_slots)
        nll = torch.zeros(B, n_gen, device=clip.device)
        all_logits = None
        for p, logits in self._passes(model, clip, sched, setup_cache):
            if not p.n_out:
                continue
            out = logits[:, p.out_rows]  # (B, n_out, V)
            if all_logits is None and keep_logits:
                all_logits = out.new_zeros(B, n_gen, out.shape[-1])
            if keep_logits:
                all_logits[:, p.out_index] = out
            nll[:, p.out_index] = F.cross_entropy(out.transpose(1, 2), clip[:, p.out_slots], reduction="none")
        return TeacherForced(sched.gen_slots.to(clip.device), nll, all_logits)

    def _passes(self, model, tokens: torch.Tensor, sched: Schedule, setup_cache: bool):
        """Run the schedule's passes; yields (pass plan, logits (B, Sq, V)). `tokens` is read as it fills."""
        check_clip(tokens, self.layout, self.frames)
        B, n_cache = tokens.shape[0], sched.n_slots + 1  # + 1 scratch slot for proxies
        if setup_cache:
            model.setup_cache(B, n_cache, device=tokens.device)
        else:
            cache = model.layers[0].attention.cache
            if cache is None or cache.k.shape[0] != B or cache.k.shape[2] != n_cache:
                raise ValueError(f"setup_cache=False needs a cache set up for batch {B} and {n_cache} slots")
        for p in sched.plan(self.full, tokens.device):
            yield p, model(tokens[:, p.src], p.coords, p.mask, p.cache_pos)


class NTPSampler(DiagDSampler):
    """Next-token prediction: the raster schedule (k = w, d = h*w), one image token per pass."""

    name = "ntp"

    def __init__(self, layout: Layout, frames: int, prompt_frames: int = 1, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None):
        super().__init__(layout, frames, prompt_frames, k=layout.w, d=layout.h * layout.w,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def diagd_val_loss(model, sampler: DiagDSampler, clip: torch.Tensor, prompt_frames: int | None = None):
    """Teacher-forced DiagD validation loss: mean cross-entropy over the generated image tokens."""
    return sampler.teacher_forced(model, clip, prompt_frames, keep_logits=False).nll.mean()


SAMPLERS = {"ntp": NTPSampler, "diagd": DiagDSampler}


def build_sampler(cfg, layout: Layout, frames: int) -> DiagDSampler:
    """sampler=<name> from the config (a dict or DictConfig) -> a sampler for clips of `frames` frames."""
    kw = dict(cfg)
    name = kw.pop("name", None)
    if name not in SAMPLERS:
        raise ValueError(f"sampler.name={name!r} is unknown; choose one of {sorted(SAMPLERS)}")
    return SAMPLERS[name](layout, frames, **kw)
