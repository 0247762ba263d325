"""NTP and DiagD samplers on the model's static KV cache (plain torch, gpt-fast style).

One forward pass per schedule pass: pass s feeds exactly the rows the schedule feeds in pass s (real slots
with F = s, written to their cache slot after attending; proxies, written to a scratch slot no mask shows)
under the visibility rule of DIAGD.md section 5, and samples every output that predicts a generated token.
All per-pass tensors come precomputed from `Schedule.plan`; the loop only gathers, runs the model and samples
on device (no host syncs). Eager (the CPU path), each pass attends only to the cache prefix it can see.
`static=True` pads every pass after the prefill to the widest one (padded rows read token 0, write the scratch
slot, see only themselves; padded outputs land in a dummy token column), so one compiled graph serves all
passes: `compile=True` (the GPU path) compiles that step with `mode="reduce-overhead"` (CUDA graphs). A teacher-forced mode takes the clip's tokens instead of sampling and returns the
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
class StaticPlan:
    """The schedule's passes after the prefill, padded to one shape (P passes, W rows, O outputs)."""

    src: torch.Tensor  # (P, W) long: token column of each input row (padding: 0)
    coords: torch.Tensor  # (P, W, 3) long
    cache_pos: torch.Tensor  # (P, W) long: cache slot written (proxies, padding: the scratch slot N)
    mask: torch.Tensor  # (P, 1, W, N+1+W) bool: [all cache slots + scratch | this pass's (padded) inputs]
    out_rows: torch.Tensor  # (P, O) long: rows sampled (padding: row 0)
    out_slots: torch.Tensor  # (P, O) long: token column written (padding: the dummy column N)


def pad_plans(plans, n_slots: int, dev) -> StaticPlan:
    """Stack PassPlans (all but the prefill) into static shapes; nothing here knows the schedule's rules."""
    P, N = len(plans), n_slots
    W, O = max((len(p.src) for p in plans), default=1), max((p.n_out for p in plans), default=1) or 1
    st = StaticPlan(
        src=torch.zeros(P, W, dtype=torch.long, device=dev),
        coords=torch.ones(P, W, 3, dtype=torch.long, device=dev),
        cache_pos=torch.full((P, W), N, dtype=torch.long, device=dev),
        mask=torch.zeros(P, 1, W, N + 1 + W, dtype=torch.bool, device=dev),
        out_rows=torch.zeros(P, O, dtype=torch.long, device=dev),
        out_slots=torch.full((P, O), N, dtype=torch.long, device=dev),
    )
    st.mask[:, 0, torch.arange(W), N + 1 + torch.arange(W)] = True  # every row sees itself (padding: only that)
    for s, p in enumerate(plans):
        sq, n = len(p.src), p.n_vis
        st.src[s, :sq], st.coords[s, :sq], st.cache_pos[s, :sq] = p.src, p.coords, p.cache_pos
        st.mask[s, 0, :sq, :n] = p.mask[0, :, :n]
        st.mask[s, 0, :sq, N + 1:N + 1 + sq] = p.mask[0, :, n:]
        st.out_rows[s, :p.n_out], st.out_slots[s, :p.n_out] = p.out_rows, p.out_slots
    return st


def _forward_rows(model, tokens, src, coords, mask, cache_pos, out_rows):
    """One padded pass: (B, N+1) tokens -> (B, O, V) logits of the sampled rows."""
    return model(tokens[:, src], coords, mask, cache_pos)[:, out_rows]


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
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 static: bool = False, compile: bool = False, codebook_size: int | None = None):
        if temperature < 0:
            raise ValueError(f"temperature={temperature} is invalid: it must be >= 0 (0 = greedy)")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k} is invalid: it must be >= 1 or null (off)")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p} is invalid: it must be in (0, 1] or null (off)")
        if codebook_size is not None and codebook_size < 1:
            raise ValueError(f"codebook_size={codebook_size} is invalid: it must be >= 1 or null (whole vocabulary)")
        self.layout, self.frames, self.full = layout, frames, full
        # image slots may only take image codes: ids >= codebook_size are action tokens (an undertrained model
        # would otherwise write action ids into frames); None samples from the whole vocabulary
        self.codebook_size = codebook_size
        self.schedule_args = dict(k=k, d=d, proxy=proxy)
        self.prompt_frames = prompt_frames
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
        self.static, self.compile = static or compile, compile
        self._schedules: dict[int, Schedule] = {}
        self._static: dict = {}  # (prompt_frames, device) -> StaticPlan
        self._step = _forward_rows
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
        if self.static:
            tokens, passes = self._generate_static(model, clip, sched, setup_cache, gen)
        else:
            tokens, passes = clip.clone(), 0
            for p, logits in self._passes(model, tokens, sched, setup_cache):
                passes += 1
                if p.n_out:
                    tokens[:, p.out_slots] = self._sample(logits[:, p.out_rows], gen)
        if tokens.is_cuda:
            torch.cuda.synchronize(tokens.device)
        return tokens, SampleStats(passes, tokens.shape[0] * len(sched.gen_slots), time.perf_counter() - t0)

    def _sample(self, logits: torch.Tensor, gen) -> torch.Tensor:
        """(B, O, V) logits -> (B, O) image token ids (a slice, not a mask: ids below codebook_size keep their id)."""
        if self.codebook_size is not None:
            logits = logits[..., :self.codebook_size]
        return sample(logits, self.temperature, self.top_k, self.top_p, gen)

    def static_plan(self, sched: Schedule, device) -> StaticPlan:
        key = (sched.prompt_frames, str(device))
        if key not in self._static:
            self._static[key] = pad_plans(sched.plan(self.full, device)[1:], sched.n_slots, device)
        return self._static[key]

    def _generate_static(self, model, clip, sched, setup_cache, gen):
        """Prefill (pass 0) eagerly, then every other pass through one static-shape (compiled) step."""
        st = self.static_plan(sched, clip.device)
        if self.compile and self._step is _forward_rows:
            self._step = torch.compile(_forward_rows, mode="reduce-overhead", dynamic=False)
        check_clip(clip, self.layout, self.frames)
        self._open_cache(model, clip.shape[0], sched, setup_cache, clip.device)
        tokens = torch.cat([clip, clip[:, :1]], dim=1)  # (B, N+1): column N takes padded outputs
        p = sched.plan(self.full, clip.device)[0]  # the prefill, eager
        logits = model(tokens[:, p.src], p.coords, p.mask, p.cache_pos)[:, p.out_rows]
        tokens[:, p.out_slots] = self._sample(logits, gen)
        for s in range(len(st.src)):
            logits = self._step(model, tokens, st.src[s], st.coords[s], st.mask[s], st.cache_pos[s], st.out_rows[s])
            tokens[:, st.out_slots[s]] = self._sample(logits, gen)
        return tokens[:, :-1].clone(), 1 + len(st.src)

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
        self._open_cache(model, tokens.shape[0], sched, setup_cache, tokens.device)
        for p in sched.plan(self.full, tokens.device):
            yield p, model(tokens[:, p.src], p.coords, p.mask, p.cache_pos)

    @staticmethod
    def _open_cache(model, B: int, sched: Schedule, setup_cache: bool, device) -> None:
        n_cache = sched.n_slots + 1  # + 1 scratch slot for proxies
        if setup_cache:
            model.setup_cache(B, n_cache, device=device)
        else:
            cache = model.layers[0].attention.cache
            if cache is None or cache.k.shape[0] != B or cache.k.shape[2] != n_cache:
                raise ValueError(f"setup_cache=False needs a cache set up for batch {B} and {n_cache} slots")
            model.reset_cache()  # one memset per sequence: unwritten slots hold 0, whatever ran before


class NTPSampler(DiagDSampler):
    """Next-token prediction: the raster schedule (k = w, d = h*w), one image token per pass."""

    name = "ntp"

    def __init__(self, layout: Layout, frames: int, prompt_frames: int = 1, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 static: bool = False, compile: bool = False, codebook_size: int | None = None):
        super().__init__(layout, frames, prompt_frames, k=layout.w, d=layout.h * layout.w,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, static=static,
                         compile=compile, codebook_size=codebook_size)


def diagd_val_loss(model, sampler: DiagDSampler, clip: torch.Tensor, prompt_frames: int | None = None):
    """Teacher-forced DiagD validation loss: mean cross-entropy over the generated image tokens."""
    return sampler.teacher_forced(model, clip, prompt_frames, keep_logits=False).nll.mean()


SAMPLERS = {"ntp": NTPSampler, "diagd": DiagDSampler}


def build_sampler(cfg, layout: Layout, frames: int, codebook_size: int | None = None) -> DiagDSampler:
    """sampler=<name> from the config (a dict or DictConfig) -> a sampler for clips of `frames` frames.
    codebook_size (the data's): image slots sample image codes only."""
    kw = dict(cfg)
    if codebook_size is not None:
        kw.setdefault("codebook_size", codebook_size)
    name = kw.pop("name", None)
    if name not in SAMPLERS:
        raise ValueError(f"sampler.name={name!r} is unknown; choose one of {sorted(SAMPLERS)}")
    return SAMPLERS[name](layout, frames, **kw)
