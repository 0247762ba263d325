"""NTP and DiagD samplers on the model's static KV cache (plain torch, gpt-fast style).

One forward pass per schedule pass: pass s feeds exactly the rows the schedule feeds in pass s (real slots
with F = s, written to their cache slot; proxies, written to a scratch slot no mask shows)
under the visibility rule of docs/diagd.md section 5, and samples every output that predicts a generated token.
All per-pass tensors come precomputed from `Schedule.plan`; the loop only gathers, runs the model and samples
on device (no host syncs). Eager (the CPU default), each pass attends only to the cache prefix it can see.

The static path (`static=True`, or `compile`: compile=auto is on for CUDA) runs the passes after the prefill at
the few shapes of `mcar.core.buckets`; compiled (`mcar.core.compiling`), each bucket is one CUDA graph. The prefill
stays eager. Sampling is keyed (`mcar.core.keyed_rng`): eager and static paths draw the same tokens for a seed.
A teacher-forced mode takes the clip's tokens instead of sampling and returns the logits of every generated
token: the parity test and the DiagD validation loss use it.

Past `context` frames (`context=`, null: never) generate() runs a `Rollout`: the same schedule on a rolling KV
cache of the last frames (mcar.core.rolling, docs/diagd.md section 7), any number of frames at a constant cost per
frame; a `Rollout` is also the session a caller steps one frame at a time, actions arriving as it goes.

Reading order: `forward_rows` (one pass), `sample_slots` (its outputs -> tokens under a `SamplingRule`),
`ScheduleSampler.generate` (prefill, then every pass), `teacher_forced`, `Rollout`.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mcar.core.buckets import BIAS_ALIGN, MAX_PREFIX_CLASSES, StagedBucket, StaticPlan, bucket_plans
from mcar.core.compiling import compiled
from mcar.core.keyed_rng import SlotNoise, keyed_exponential, mix32, row_keys, seed_key, value_codes
from mcar.core.layout import Layout, check_clip
from mcar.core.model import MAX_KV_SPLITS, KVCache
from mcar.core.rolling import RollingPass, RollingSchedule
from mcar.core.schedule import Schedule, ScheduleConfig


@dataclass
class SampleStats:
    passes: int  # forward passes run
    tokens: int  # image tokens generated, over the whole batch
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def filtered_logits(logits: torch.Tensor, temperature, top_k: int | None, top_p, min_p=None) -> torch.Tensor:
    """logits (..., V) -> logits after temperature, top-k, top-p and min-p (None: off), dropped ones -inf. min-p
    keeps the tokens at least min_p times as likely as the likeliest (Nguyen et al. 2024). temperature, top_p and
    min_p: floats or 0-d tensors (the compiled step's: a Python float would become a CPU input of the graph, and a
    CPU input turns CUDA graphs off)."""
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    if min_p is not None:  # p < min_p * p_max  <=>  logit < max logit + log(min_p)
        floor = logits.amax(-1, keepdim=True) + torch.log(torch.as_tensor(min_p, dtype=logits.dtype))
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


def filtered_probs(logits: torch.Tensor, temperature, top_k: int | None, top_p, min_p=None) -> torch.Tensor:
    """`filtered_logits` as probabilities: the distribution a token is drawn from."""
    return filtered_logits(logits, temperature, top_k, top_p, min_p).softmax(-1)


@dataclass(frozen=True)
class SamplingRule:
    """How an output becomes a token. temperature: a 0-d tensor, None for greedy; top_p, min_p: 0-d tensors, None
    for off (tensors, not floats: a Python float would become a CPU input of the compiled graph, which turns CUDA
    graphs off); top_k: None for off; codebook_size: image slots take image codes only (None: the whole
    vocabulary)."""

    temperature: torch.Tensor | None = None
    top_k: int | None = None
    top_p: torch.Tensor | None = None
    codebook_size: int | None = None
    min_p: torch.Tensor | None = None

    @classmethod
    def of(cls, temperature: float, top_k: int | None, top_p: float | None, codebook_size: int | None,
           device, min_p: float | None = None) -> "SamplingRule":
        if temperature <= 0 or top_k == 1:
            return cls(codebook_size=codebook_size)
        top_p = torch.tensor(top_p, device=device) if top_p is not None and top_p < 1 else None
        min_p = torch.tensor(float(min_p), device=device) if min_p else None
        return cls(torch.tensor(float(temperature), device=device), top_k, top_p, codebook_size, min_p)


def sample_slots(logits: torch.Tensor, slots: torch.Tensor, noise: SlotNoise, rule: SamplingRule) -> torch.Tensor:
    """(B, O, V) logits of the outputs predicting `slots` (O,) -> (B, O) image token ids. The noise of output
    (b, o) is keyed by (seed, b, slots[o]): the same whichever pass or padding produced it. Image slots take image
    codes only (a slice, not a mask: ids below codebook_size keep theirs)."""
    return sample_keyed(logits, noise.keys[:, slots], noise.codes, rule)


def sample_keyed(logits: torch.Tensor, keys: torch.Tensor, codes: torch.Tensor, rule: SamplingRule) -> torch.Tensor:
    """`sample_slots` with the noise keys (B, O) of its outputs given."""
    if rule.codebook_size is not None:
        logits = logits[..., :rule.codebook_size]
    if rule.temperature is None:
        return logits.argmax(-1)
    probs = filtered_probs(logits, rule.temperature, rule.top_k, rule.top_p, rule.min_p)
    race = keyed_exponential(keys, probs.shape[-1], codes)
    return (probs / race).argmax(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rule: "SamplingRule") -> torch.Tensor:
    """(..., V) logits, (...) token ids -> (...) log-probability of each token under the distribution `rule` draws
    it from (image codes only, temperature, top-k, top-p): the sampler records it as it samples, post-training
    computes it in one pass (mcar.core.policy), the two equal by the parity property. Greedy has none."""
    if rule.temperature is None:
        raise ValueError("sampler.temperature=0 (greedy) draws no distribution: log-probabilities need "
                         "temperature > 0 and top_k != 1")
    if rule.codebook_size is not None:
        logits = logits[..., :rule.codebook_size]
    logp = filtered_logits(logits, rule.temperature, rule.top_k, rule.top_p, rule.min_p).log_softmax(-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def forward_rows(model, tokens: torch.Tensor, p) -> torch.Tensor:
    """One pass: the rows `p` feeds (a PassPlan, or a bucket's PassInputs) -> (B, O, V) logits of the rows it
    samples. tokens (B, N) or (B, N+1) (the static path's dummy column) is read as it fills."""
    return model(tokens[:, p.src], p.coords, p.mask, p.cache_pos)[:, p.out_rows]


def _sample_pass(model, tokens, p, noise: SlotNoise, rule: SamplingRule) -> torch.Tensor:
    """One pass, sampled: -> (B, O) token ids for `p.out_slots` (the caller writes them: CUDA graphs do not
    take a mutated input other than the cache buffers)."""
    return sample_slots(forward_rows(model, tokens, p), p.out_slots, noise, rule)


def _sample_rolling_pass(model, tokens, p: RollingPass, rows: torch.Tensor, first_slots: torch.Tensor,
                         codes: torch.Tensor, rule: SamplingRule) -> torch.Tensor:
    """One pass of a `Rollout`, sampled: its noise keyed by each row's key and the slot in that row's open-ended
    clip (`p.out_abs` from the rollout's first frame, + `first_slots` (B, 1): where that frame sits in the row's
    own clip), so a frame draws the same noise whichever ring columns it lands in and whenever its rollout began."""
    return sample_keyed(forward_rows(model, tokens, p), mix32(rows ^ (p.out_abs + first_slots)), codes, rule)


def _scored_rolling_pass(model, tokens, p: RollingPass, rows: torch.Tensor, first_slots: torch.Tensor,
                         codes: torch.Tensor, rule: SamplingRule) -> tuple[torch.Tensor, torch.Tensor]:
    """`_sample_rolling_pass`, and the log-probability of each token drawn (`token_logprobs`)."""
    logits = forward_rows(model, tokens, p)
    drawn = sample_keyed(logits, mix32(rows ^ (p.out_abs + first_slots)), codes, rule)
    return drawn, token_logprobs(logits, drawn, rule)


@dataclass
class TeacherForced:
    slots: torch.Tensor  # (n_gen,) long: the generated slots, in layout order
    nll: torch.Tensor  # (B, n_gen) float32: cross-entropy of each generated token
    logits: torch.Tensor | None  # (B, n_gen, V) float32, when asked for


@dataclass
class Rolled:
    tokens: torch.Tensor  # (B, N) the clip, its generated frames filled in
    passes: int
    logprobs: torch.Tensor | None  # (B, N): log-probability of each generated token as drawn, 0 elsewhere


class ScheduleSampler:
    """Generates on a schedule: DiagD (`schedule`, a ScheduleConfig or its fields as keywords) or NTP
    (`ScheduleSampler.ntp`: the raster schedule k = w, d = h*w, one image token per pass). prompt_frames, when
    given, overrides the schedule's."""

    def __init__(self, layout: Layout, frames: int, prompt_frames: int | None = None, *,
                 schedule: ScheduleConfig | dict | None = None, name: str = "diagd", temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
                 seed: int | None = None, static: bool = False, compile: bool | str = False, static_widths: int = 3,
                 codebook_size: int | None = None, context: int | None = None, kv_splits: int | str = "auto",
                 **schedule_fields):
        check_settings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, codebook_size=codebook_size,
                       compile=compile, static_widths=static_widths, kv_splits=kv_splits)
        self.config = ScheduleConfig.of(schedule, prompt_frames=prompt_frames, **schedule_fields)
        self.name, self.layout, self.frames, self.full = name, layout, frames, self.config.full
        # image slots may only take image codes: ids >= codebook_size are action tokens (an undertrained model
        # would otherwise write action ids into frames); None samples from the whole vocabulary
        self.codebook_size = codebook_size
        self.prompt_frames = self.config.prompt_frames
        self.temperature, self.top_k, self.top_p, self.min_p, self.seed = temperature, top_k, top_p, min_p, seed
        self.static, self.static_widths = static, static_widths
        self.kv_splits = kv_splits  # the model's cached passes read the keys in this many slices (kv_splits_for)
        self.compile = compile if compile == "auto" else bool(compile)
        self._schedules: dict[int, Schedule] = {}
        self._static: dict = {}  # (prompt_frames, device) -> StaticPlan
        self._staged: dict = {}  # (prompt_frames, device, GQA groups, dtype) -> its StagedBuckets
        self._held: dict = {}  # (name, shape, dtype, device) -> a tensor the compiled step reads at a fixed address
        self._compiled: dict = {}  # plain step function -> its torch.compile wrapper
        self._rolling: dict = {}  # (static, device) -> RollingSchedule
        sched = self.schedule(self.prompt_frames)  # validate now, at config time
        if self.full:
            sched.check_full()
        self.context = context  # frames the model sees at once past which generate() rolls; None: never
        if self.rolls():
            self.rolling_schedule("cpu")  # validate now

    @classmethod
    def ntp(cls, layout: Layout, frames: int, prompt_frames: int | None = None, *,
            schedule: ScheduleConfig | dict | None = None, **kw) -> "ScheduleSampler":
        """Next-token prediction: the raster schedule (k = w, d = h*w, no proxies), prompt frames from
        `schedule` unless given."""
        P = ScheduleConfig.of(schedule, prompt_frames=prompt_frames).prompt_frames
        return cls(layout, frames, P, name="ntp", k=layout.w, d=layout.h * layout.w, full=False, **kw)

    def compiles(self, device) -> bool:
        """Whether generate() on `device` runs the compiled (CUDA graph) step: compile=auto means on CUDA."""
        return self.compile is True or (self.compile == "auto" and torch.device(device).type == "cuda")

    def is_static(self, device) -> bool:
        """Whether generate() on `device` runs the bucketed static shapes (compiling implies them)."""
        return bool(self.static) or self.compiles(device)

    def sampling_rule(self, device) -> SamplingRule:
        """The one rule this sampler draws under (its temperature, top_k, top_p, min_p, image codes only), on
        `device`."""
        return SamplingRule.of(self.temperature, self.top_k, self.top_p, self.codebook_size, device, self.min_p)

    def rolls(self, frames: int | None = None) -> bool:
        """Whether generate() on clips of `frames` frames (default: the sampler's) runs a rolling `Rollout`."""
        return self.context is not None and (frames or self.frames) > self.context

    def rolling_schedule(self, device) -> RollingSchedule:
        """The sampler's schedule on a rolling cache of `context` frames (static shapes where generate() uses them)."""
        static = self.is_static(device)
        key = (static, str(device))
        if key not in self._rolling:
            self._rolling[key] = RollingSchedule(self.layout, self.config, self.context, self.full, device,
                                                 self.static_widths if static else None)
        return self._rolling[key]

    def rollout(self, model, prompt: torch.Tensor, setup_cache: bool = True, *, temperature: float | None = None,
                top_k: int | None = None, noise_keys: torch.Tensor | None = None,
                first_frames: torch.Tensor | None = None, logprobs: bool = False) -> "Rollout":
        """A `Rollout` from `prompt` (B, P*frame_len): the prompt frames and their actions. temperature, top_k: this
        rollout's sampling (None: the sampler's; the sampler itself is never changed). noise_keys (B,) int: each
        row's own noise key (None: keyed by the sampler's seed and the batch row); first_frames (B,) int: the
        index of the prompt's first frame in each row's own clip (None: 0), so a row draws the same noise for its
        frame f whenever its rollout began. logprobs: keep each frame's tokens' log-probabilities
        (`Rollout.frame_logprobs`)."""
        return Rollout(self, model, prompt, setup_cache, temperature=temperature, top_k=top_k,
                       noise_keys=noise_keys, first_frames=first_frames, logprobs=logprobs)

    @property
    def label(self) -> str:
        """'ntp', or 'diagd k=2[ d=28][ proxy=above][ full]', then how tokens are drawn where it is not plain
        sampling at temperature 1 ('greedy', 'T=0.7', 'top_k=50', 'top_p=0.9', 'min_p=0.1'): rows, columns, logs."""
        c = self.config
        label = self.name if self.name != "diagd" else (
            f"diagd k={c.k}" + (f" d={c.d}" if c.d is not None else "")
            + (f" proxy={c.proxy}" if c.proxy != ScheduleConfig.proxy else "") + (" full" if c.full else ""))
        if self.temperature <= 0 or self.top_k == 1:
            return label + " greedy"
        drawn = [f"T={self.temperature:g}" if self.temperature != 1 else "",
                 f"top_k={self.top_k}" if self.top_k is not None else "",
                 f"top_p={self.top_p:g}" if self.top_p is not None else "",
                 f"min_p={self.min_p:g}" if self.min_p else ""]
        return " ".join([label, *filter(None, drawn)])

    def schedule(self, prompt_frames: int | None = None) -> Schedule:
        P = self.prompt_frames if prompt_frames is None else prompt_frames
        if P not in self._schedules:
            self._schedules[P] = Schedule.of(self.layout, self.frames, self.config, P)
        return self._schedules[P]

    @torch.no_grad()
    def generate(self, model, clip: torch.Tensor, prompt_frames: int | None = None,
                 setup_cache: bool = True) -> tuple[torch.Tensor, SampleStats]:
        """clip (B, N): prompt frames + every action (other image tokens are ignored) -> (B, N) filled in.
        Seeded, the tokens depend on (seed, batch row, slot) only: eager and static paths agree."""
        sched = self.schedule(prompt_frames)
        t0 = time.perf_counter()
        n_values = min(self.codebook_size or math.inf, model.cfg.vocab_size)  # what sample_slots draws from
        if self.rolls():
            if prompt_frames not in (None, self.prompt_frames):
                raise ValueError(f"a rolling rollout runs its schedule's prompt_frames={self.prompt_frames}, "
                                 f"not {prompt_frames}")
            rolled = self.roll(model, clip, setup_cache)
            return self._done(rolled.tokens, rolled.passes, sched, t0)
        # one key per (batch row, slot), the dummy column N included
        noise = SlotNoise.of(seed_key(self.seed), clip.shape[0], clip.shape[1] + 1, n_values, clip.device)
        rule = self.sampling_rule(clip.device)
        if self.is_static(clip.device):
            tokens, passes = self._generate_static(model, clip, sched, setup_cache, noise, rule)
        else:
            tokens, passes = clip.clone(), 0
            for p in self._open(model, tokens, sched, setup_cache):
                passes += 1
                logits = forward_rows(model, tokens, p)
                if p.n_out:
                    tokens[:, p.out_slots] = sample_slots(logits, p.out_slots, noise, rule)
        return self._done(tokens, passes, sched, t0)

    @staticmethod
    def _done(tokens, passes: int, sched: Schedule, t0: float) -> tuple[torch.Tensor, SampleStats]:
        if tokens.is_cuda:
            torch.cuda.synchronize(tokens.device)
        return tokens, SampleStats(passes, tokens.shape[0] * len(sched.gen_slots), time.perf_counter() - t0)

    def roll(self, model, clip: torch.Tensor, setup_cache: bool = True, *, noise_keys: torch.Tensor | None = None,
             logprobs: bool = False) -> "Rolled":
        """Every frame of `clip` (B, N: prompt frames + every action) through one `Rollout` on the rolling cache,
        its actions the clip's. noise_keys (B,): each row's own noise (None: the sampler's seed and the row);
        logprobs: also the log-probability of each token drawn, as drawn (`token_logprobs`)."""
        check_clip(clip, self.layout, self.frames)
        L, hw, P = self.layout.frame_len, self.layout.frame_tokens, self.prompt_frames
        run = self.rollout(model, clip[:, :P * L], setup_cache, noise_keys=noise_keys, logprobs=logprobs)
        tokens = clip.clone()
        logp = run.logp.new_zeros(clip.shape) if logprobs else None
        frames = [run.advance(clip[:, (t - 1) * L + hw:t * L]) for t in range(P, self.frames)] + run.finish()
        for u, frame in enumerate([f for f in frames if f is not None], start=P):
            tokens[:, u * L:u * L + hw] = frame
            if logp is not None:
                logp[:, u * L:u * L + hw] = run.frame_logprobs[u - P]
        return Rolled(tokens, run.passes, logp)

    def static_plan(self, sched: Schedule, device) -> StaticPlan:
        key = (sched.prompt_frames, str(device))
        if key not in self._static:
            vis_step = self.layout.frame_len * -(-(self.frames - sched.prompt_frames) // MAX_PREFIX_CLASSES)
            self._static[key] = bucket_plans(sched.plan(self.full, device)[1:], sched.n_slots, self.static_widths,
                                             vis_step, device, align=BIAS_ALIGN)
        return self._static[key]

    def staged_buckets(self, sched: Schedule, model, device) -> list[StagedBucket]:
        """The static plan's buckets as the compiled step reads them, for `model` (its GQA groups, cache dtype)."""
        caches = model.kv_caches()
        dtype = model.cache_dtype(device) if caches is None else caches[0].k_buf.dtype
        groups = model.cfg.n_heads // model.cfg.n_kv_heads
        key = (sched.prompt_frames, str(device), groups, dtype)
        if key not in self._staged:
            self._staged[key] = [StagedBucket(b, groups, dtype) for b in self.static_plan(sched, device).buckets]
        return self._staged[key]

    def held(self, name: str, value: torch.Tensor | None) -> torch.Tensor | None:
        """`value` copied into a tensor this sampler keeps at one address (one per name, shape, dtype and device),
        marked static: what the compiled step reads for a whole sequence (tokens, noise keys, the rule's
        tensors). CUDA graphs copy an input that is not static at every replay, and re-record for a static one
        that moved."""
        if value is None:
            return None
        key = (name, tuple(value.shape), value.dtype, str(value.device))
        if key not in self._held:
            self._held[key] = torch.empty_like(value)
            torch._dynamo.mark_static_address(self._held[key], guard=False)
        return self._held[key].copy_(value)

    def step_fn(self, fn, device):
        """`fn` (a per-pass step) as generate() on `device` runs it: compiled once per sampler, or plain."""
        if not self.compiles(device):
            return fn
        if fn not in self._compiled:
            self._compiled[fn] = compiled(fn, device)
        return self._compiled[fn]

    def _generate_static(self, model, clip, sched, setup_cache, noise, rule):
        """Prefill (pass 0) eagerly, then every other pass through its bucket's static-shape (compiled) step, every
        input of which sits at a fixed address (`StagedBucket`, `held`)."""
        order = self.static_plan(sched, clip.device).order
        step = self.step_fn(_sample_pass, clip.device)
        tokens = self.held("tokens", torch.cat([clip, clip[:, :1]], dim=1))  # (B, N+1): column N takes padded outputs
        noise = SlotNoise(self.held("noise keys", noise.keys), self.held("noise codes", noise.codes))
        rule = SamplingRule(self.held("temperature", rule.temperature), rule.top_k, self.held("top_p", rule.top_p),
                            rule.codebook_size, self.held("min_p", rule.min_p))
        prefill = next(self._open(model, clip, sched, setup_cache))  # eager
        tokens[:, prefill.out_slots] = _sample_pass(model, tokens, prefill, noise, rule)
        buckets = self.staged_buckets(sched, model, clip.device)  # after _open: the cache's dtype is the model's
        for g, i in order:
            p = buckets[g].load(i)
            tokens[:, p.out_slots] = step(model, tokens, p, noise, rule)
        return tokens[:, :-1].clone(), 1 + len(order)

    @torch.no_grad()
    def teacher_forced(self, model, clip: torch.Tensor, prompt_frames: int | None = None,
                       setup_cache: bool = True, keep_logits: bool = True) -> TeacherForced:
        """Feed the clip's own tokens on the sampler's schedule; score every generated token."""
        sched = self.schedule(prompt_frames)
        B, n_gen = clip.shape[0], len(sched.gen_slots)
        nll = torch.zeros(B, n_gen, device=clip.device)
        all_logits = None
        for p in self._open(model, clip, sched, setup_cache):
            out = forward_rows(model, clip, p)  # (B, n_out, V)
            if not p.n_out:
                continue
            if all_logits is None and keep_logits:
                all_logits = out.new_zeros(B, n_gen, out.shape[-1])
            if keep_logits:
                all_logits[:, p.out_index] = out
            nll[:, p.out_index] = F.cross_entropy(out.transpose(1, 2), clip[:, p.out_slots], reduction="none")
        return TeacherForced(sched.gen_slots.to(clip.device), nll, all_logits)

    def _open(self, model, clip: torch.Tensor, sched: Schedule, setup_cache: bool):
        """Check the clip, open the cache, then yield the schedule's pass plans in order (the caller runs each)."""
        check_clip(clip, self.layout, self.frames)
        self._open_cache(model, clip.shape[0], sched.n_slots + 1, setup_cache, clip.device)  # + 1: proxies' scratch
        yield from sched.plan(self.full, clip.device)

    def kv_splits_for(self, batch: int, n_kv_heads: int, device) -> int:
        """How many slices of the keys a cached pass attends over (mcar.core.model.split_bias). auto: on CUDA, enough
        that (batch x KV heads x slices) blocks fill the GPU's SMs (up to 8: one player of the 700m MHA model gets 4
        on an H100's 132, a GQA model more, 4+ players 1), as flash-decoding does; 1 elsewhere (CPU threads already
        share the keys)."""
        if self.kv_splits != "auto":
            return int(self.kv_splits)
        device = torch.device(device)
        if device.type != "cuda":
            return 1
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(MAX_KV_SPLITS, sms // (batch * n_kv_heads)))

    def _open_cache(self, model, B: int, n_cache: int, setup_cache: bool, device) -> None:
        model.kv_splits = self.kv_splits_for(B, model.cfg.n_kv_heads, device)
        caches = model.kv_caches()
        cache = caches[0] if caches else None
        shaped = cache is not None and cache.k.shape[0] == B and cache.k.shape[2] == n_cache
        if setup_cache:
            device = torch.device(device)
            if not (shaped and cache.k.device == device and cache.k.dtype == model.cache_dtype(device)):
                model.setup_cache(B, n_cache, device=device)
                return
            # else reused in place, not reallocated: compiled CUDA graphs keep reading the same buffers
        elif not shaped:
            raise ValueError(f"setup_cache=False needs a cache set up for batch {B} and {n_cache} slots")
        model.reset_cache()  # one memset per sequence: unwritten slots hold 0, whatever ran before


class Rollout:
    """A world that goes on: B clips generated frame after frame on a rolling KV cache (mcar.core.rolling), the
    sampler's schedule and sampling; one `advance` per frame, actions given as they come.

    `advance(actions)` takes the action after the newest started frame (B, n_a) and runs the d passes that start
    the next frame; it returns the image tokens (B, h*w) of the frame those passes completed, or None while the
    first `in_flight - 1` advances fill the diagonal (in_flight = 1 when d = s_spa, the default: every advance
    returns the frame its action leads to). `finish()` completes the frames still in flight. The tokens depend on
    (seed, batch row, slot in the open-ended clip) only: eager and static paths agree. The KV cache is the
    model's: one rollout per model at a time (sessions are its batch rows); another generate or rollout on the
    model takes the cache, and this one then refuses to advance."""

    def __init__(self, sampler: ScheduleSampler, model, prompt: torch.Tensor, setup_cache: bool = True, *,
                 temperature: float | None = None, top_k: int | None = None, noise_keys: torch.Tensor | None = None,
                 first_frames: torch.Tensor | None = None, logprobs: bool = False):
        device = prompt.device
        plan = sampler.rolling_schedule(device)
        L, P = sampler.layout.frame_len, plan.prompt_frames
        if prompt.dim() != 2 or prompt.shape[1] != P * L:
            raise ValueError(f"prompt has shape {tuple(prompt.shape)}, a rollout wants (B, {P} prompt frames x {L})")
        self.sampler, self.model, self.plan = sampler, model, plan
        B = prompt.shape[0]
        self.tokens = prompt.new_zeros(B, plan.n_token_cols)  # the ring's token columns, the dummy, any pinned
        self.tokens[:, :P * L] = prompt  # frame f < P < ring sits at column f*L
        if plan.pinned is not None:
            self.tokens[:, plan.pinned:plan.pinned + L] = prompt[:, :L]
        n_values = min(sampler.codebook_size or math.inf, model.cfg.vocab_size)
        self.rows = row_keys(seed_key(sampler.seed), B, device) if noise_keys is None else \
            mix32(torch.as_tensor(noise_keys, device=device).long())[:, None]
        first = torch.zeros(B, dtype=torch.long) if first_frames is None else torch.as_tensor(first_frames).long()
        self.first_slots = (first * L).reshape(B, 1).to(device)
        self.codes = value_codes(n_values, device)
        temperature = sampler.temperature if temperature is None else temperature
        top_k = sampler.top_k if top_k is None else top_k
        self.rule = SamplingRule.of(temperature, top_k, sampler.top_p, sampler.codebook_size, device, sampler.min_p)
        if sampler.is_static(device):  # what every rollout of this sampler shares, at one address (held: static)
            r = self.rule
            self.codes = sampler.held("value codes", self.codes)
            self.rule = SamplingRule(sampler.held(f"temperature {temperature}", r.temperature), r.top_k,
                                     sampler.held(f"top_p {sampler.top_p}", r.top_p), r.codebook_size,
                                     sampler.held(f"min_p {sampler.min_p}", r.min_p))
        sampler._open_cache(model, B, plan.cache_slots, setup_cache, device)
        self.kv_splits = model.kv_splits  # this rollout's width's: set again at each advance (play swaps groups in)
        model.reset_cache()  # zeroed now: a fresh cache would otherwise be zeroed at the first forward of anyone
        self._cache = model.kv_caches()[0]  # the buffers are taken over in place when someone else opens
        if sampler.is_static(device):
            self._pin_inputs()
        self._cache_version = self._cache.k_buf._version
        self.step = sampler.step_fn(_scored_rolling_pass if logprobs else _sample_rolling_pass, device)
        # static shapes (compiled or not): the passes staged at fixed addresses, their bias built once
        self.staged = plan.staged(model.cfg.n_heads // model.cfg.n_kv_heads, self._cache.k_buf.dtype) \
            if sampler.is_static(device) else None
        # log-probabilities of the tokens drawn, in the ring's columns as the tokens; each returned frame's kept
        exact = model.output.weight.dtype == torch.float64  # a float64 model's log-probabilities kept as such (tests)
        self.logp = torch.zeros(self.tokens.shape, dtype=torch.float64 if exact else torch.float32,
                                device=device) if logprobs else None
        self.frame_logprobs: list[torch.Tensor] = []  # (B, h*w) per frame returned, in order, when kept
        self.advances, self.passes = 0, 0
        self._last_actions: torch.Tensor | None = None

    @property
    def frames_done(self) -> int:
        """Frames complete so far, the prompt's included."""
        return self.plan.prompt_frames + max(self.advances - self.plan.in_flight + 1, 0)

    @torch.no_grad()
    def advance(self, actions: torch.Tensor) -> torch.Tensor | None:
        plan, a, lay = self.plan, self.advances, self.sampler.layout
        caches = self.model.kv_caches()
        cache = caches[0] if caches else None
        if cache is not self._cache or cache.k_buf._version != self._cache_version:
            raise RuntimeError("this rollout's KV cache was reopened by another generate or rollout on the model: "
                               "start a new rollout (one per model at a time; batch sessions as its rows)")
        self.model.kv_splits = self.kv_splits
        u = plan.prompt_frames + a  # the frame this advance starts
        start = plan.column(u - 1) + lay.frame_tokens
        self.tokens[:, start:start + lay.n_a] = actions.reshape(self.tokens.shape[0], lay.n_a)
        self._last_actions = actions
        args = (self.rows, self.first_slots, self.codes, self.rule)
        if a == 0:  # the prefill, eager
            self._write(plan.prefill, (_sample_rolling_pass if self.logp is None else _scored_rolling_pass)(
                self.model, self.tokens, plan.prefill, *args))
            self.passes += 1
        for p in (plan.passes(a) if self.staged is None else self.staged.passes(a)):
            self._write(p, self.step(self.model, self.tokens, p, *args))
            self.passes += 1
        self.advances += 1
        self._cache_version = cache.k_buf._version
        done = u - plan.in_flight + 1
        if done < plan.prompt_frames:
            return None
        c = plan.column(done)
        if self.logp is not None:
            self.frame_logprobs.append(self.logp[:, c:c + lay.frame_tokens].clone())
        return self.tokens[:, c:c + lay.frame_tokens].clone()

    def _pin_inputs(self) -> None:
        """The rollout's own step inputs (tokens, row keys, first slots) moved into tensors kept on its KV cache set,
        marked static: a cache set serves one rollout at a time, and a later rollout on the same set (play's cache
        pool) finds them at the same addresses, so CUDA graphs copy none of them per replay and record nothing
        again."""
        kept = self._cache.__dict__.setdefault("_rollout_inputs", {})
        key = tuple((tuple(t.shape), t.dtype) for t in (self.tokens, self.rows, self.first_slots))
        if key not in kept:
            kept[key] = tuple(torch.empty_like(t) for t in (self.tokens, self.rows, self.first_slots))
            for t in kept[key]:
                torch._dynamo.mark_static_address(t, guard=False)
        for dst, src in zip(kept[key], (self.tokens, self.rows, self.first_slots)):
            dst.copy_(src)
        self.tokens, self.rows, self.first_slots = kept[key]

    def _write(self, p: RollingPass, drawn) -> None:
        """A pass's tokens (and log-probabilities, when kept) into their ring columns."""
        if self.logp is not None:
            drawn, logp = drawn
            self.logp[:, p.out_slots] = logp
        self.tokens[:, p.out_slots] = drawn

    def split(self, rows: list[int], into: list[KVCache] | None = None) -> "Rollout":
        """A new rollout of batch rows `rows` of this one, with copies of their KV cache (installed in the model):
        it goes on exactly as those rows would have here. into: the caches to copy them into (a set of len(rows)
        rows, otherwise shaped as this one's: kept at their addresses for CUDA graphs; None: new ones). This
        rollout's cache must be the model's (the caller swaps it back in afterwards when both go on)."""
        caches = self.model.kv_caches()
        if caches is None or caches[0] is not self._cache:
            raise RuntimeError("split: this rollout's KV cache is not the model's: swap it in first")
        index = torch.as_tensor(rows, dtype=torch.long, device=self.tokens.device)
        out = copy.copy(self)
        out.tokens, out.rows, out.first_slots = self.tokens[index].clone(), self.rows[index], self.first_slots[index]
        out.logp = None if self.logp is None else self.logp[index].clone()
        out._last_actions = None if self._last_actions is None else self._last_actions[index]
        self.model.swap_caches([c.select(index, to) for c, to in zip(caches, into or [None] * len(caches))])
        out._cache = self.model.kv_caches()[0]
        out.kv_splits = self.sampler.kv_splits_for(len(rows), self.model.cfg.n_kv_heads, self.tokens.device)
        if self.sampler.is_static(self.tokens.device):
            out._pin_inputs()
        out._cache_version = out._cache.k_buf._version
        return out

    def finish(self) -> list[torch.Tensor]:
        """The frames still in flight, completed by `in_flight - 1` more advances on the last action (the frames
        those start are never shown, and no row of an earlier frame sees them)."""
        if self._last_actions is None:
            return []
        return [self.advance(self._last_actions) for _ in range(self.plan.in_flight - 1)]


def check_settings(temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                   min_p: float | None = None, codebook_size: int | None = None, compile: bool | str = False,
                   static_widths: int = 3,
                   kv_splits: int | str = "auto", **_) -> None:
    """A sampler's own settings, each checked (ValueError naming the field): what ScheduleSampler refuses."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} is invalid: it must be >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} is invalid: it must be >= 1 or null (off)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} is invalid: it must be in (0, 1] or null (off)")
    if min_p is not None and not 0 <= min_p < 1:
        raise ValueError(f"min_p={min_p} is invalid: it must be in [0, 1) or null (off)")
    if codebook_size is not None and codebook_size < 1:
        raise ValueError(f"codebook_size={codebook_size} is invalid: it must be >= 1 or null (whole vocabulary)")
    if compile not in (True, False, "auto"):
        raise ValueError(f"compile={compile!r} is invalid: choose true, false or auto (on for CUDA)")
    if static_widths < 1:
        raise ValueError(f"static_widths={static_widths} is invalid: it must be >= 1")
    if kv_splits != "auto" and not (isinstance(kv_splits, int) and kv_splits >= 1):
        raise ValueError(f"kv_splits={kv_splits!r} is invalid: an integer >= 1 (1: one attention call over the keys) "
                         f"or auto (CUDA: enough to fill the GPU; CPU: 1)")


SAMPLERS = ("ntp", "diagd")


def sampler_fields(cfg, codebook_size: int | None = None) -> tuple[str, dict]:
    """sampler=<name> (a dict or DictConfig of the sampler group) -> (its name, its other fields), the name and
    the fields that belong to the schedule group checked."""
    kw = dict(cfg)
    if codebook_size is not None:
        kw.setdefault("codebook_size", codebook_size)
    name = kw.pop("name", None)
    if name not in SAMPLERS:
        raise ValueError(f"sampler.name={name!r} is unknown; choose one of {sorted(SAMPLERS)}")
    moved = sorted(set(kw) & {"k", "d", "proxy", "full", "prompt_frames"})
    if moved:
        raise ValueError(f"sampler.{moved[0]} is a schedule setting: set schedule.{moved[0]} (conf/schedule/), which "
                         f"the training mask, validation and every sampler share")
    return name, kw


def check_sampler_config(cfg, layout: Layout, frames: int, schedule: ScheduleConfig | dict | None = None) -> Schedule:
    """What build_sampler checks, without building a sampler (training, before its data) -> the run's schedule
    (`Schedule.of`: the one object its mask and samplers share)."""
    check_settings(**sampler_fields(cfg)[1])
    config = ScheduleConfig.of(schedule)
    sched = Schedule.of(layout, frames, config)
    if config.full:
        sched.check_full()
    return sched


def build_sampler(cfg, layout: Layout, frames: int, codebook_size: int | None = None,
                  schedule: ScheduleConfig | dict | None = None) -> ScheduleSampler:
    """sampler=<name> (a dict or DictConfig of the sampler group) on the run's `schedule` (the schedule group)
    -> a sampler for clips of `frames` frames. codebook_size (the data's): image slots sample image codes only.
    compile: auto is resolved per device at generate time (`ScheduleSampler.compiles`)."""
    name, kw = sampler_fields(cfg, codebook_size)
    if name == "ntp":
        return ScheduleSampler.ntp(layout, frames, schedule=schedule, **kw)
    return ScheduleSampler(layout, frames, schedule=schedule, **kw)
