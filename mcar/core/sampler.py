"""NTP and DiagD samplers on the model's static KV cache (plain torch, gpt-fast style).

One forward pass per schedule pass: pass s feeds exactly the rows the schedule feeds in pass s (real slots
with F = s, written to their cache slot after attending; proxies, written to a scratch slot no mask shows)
under the visibility rule of docs/diagd.md section 5, and samples every output that predicts a generated token.
All per-pass tensors come precomputed from `Schedule.plan`; the loop only gathers, runs the model and samples
on device (no host syncs). Eager (the CPU default), each pass attends only to the cache prefix it can see.

The static path (`static=True`, or `compile`: compile=auto is on for CUDA) groups the passes after the prefill
into a few buckets of one shape each: a pass's rows are rounded up to one of at most `static_widths` widths,
its visible cache prefix to the longest in its bucket (buckets split the passes by generated frame). Padded
rows read token 0, write the scratch slot and see only themselves; padded outputs land in a dummy token column.
Compiled (torch.compile, mode="reduce-overhead"), each bucket is one CUDA graph. The prefill stays eager.

Sampling is keyed: the noise behind output (b, slot) is a hash of (seed, batch row b, slot, code), so the
eager and the static path (any padding, any bucketing) draw the same tokens for the same seed.
A teacher-forced mode takes the clip's tokens instead of sampling and returns the logits of every generated
token: the parity test and the DiagD validation loss use it.
"""
from __future__ import annotations

import itertools
import math
import time
import types
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mcar.core.layout import Layout, check_clip
from mcar.core.schedule import PassPlan, Schedule, ScheduleConfig

MAX_PREFIX_CLASSES = 16  # static path: cache-prefix classes, one per generated frame up to this many


@dataclass
class SampleStats:
    passes: int  # forward passes run
    tokens: int  # image tokens generated, over the whole batch
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


# ---- keyed randomness -------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32), in int64 without overflow (c in two 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x):
    """lowbias32 (C. Wellons), a bijective 32-bit hash; on Python ints and int64 tensors alike."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed: int | None) -> int:
    """A 32-bit key from any integer seed; None draws one from torch's global RNG (CPU: no device sync)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()))
    return mix32(mix32(seed & _M32) ^ ((seed >> 32) & _M32))


def value_codes(n: int, device=None) -> torch.Tensor:
    """(n,) int64: the hashed code of each value v < n (so keys close in value give unrelated rows)."""
    return mix32(torch.arange(n, device=device))


def keyed_exponential(key: torch.Tensor, n: int, codes: torch.Tensor | None = None) -> torch.Tensor:
    """key (...) int64 -> (..., n) float32 Exp(1) draws, element v a function of (key, v) alone.
    codes: `value_codes(n)`, when the caller keeps them (a sampler computes them once, not per pass)."""
    codes = value_codes(n, key.device) if codes is None else codes
    bits = mix32(key[..., None] ^ codes)
    u = ((bits >> 8).float() + 0.5) * 2.0**-24  # 24 bits: exact in float32, never 0 or 1
    return -torch.log(u)


@dataclass
class SlotNoise:
    """The keys of a keyed sampling run, hashed once before its passes (each op costs ~5 us per pass on CPU):
    output (b, slot) draws `keyed_exponential(keys[b, slot], n, codes)`."""

    keys: torch.Tensor  # (B, n_slots) int64: mix32(mix32(seed key ^ b) ^ slot)
    codes: torch.Tensor  # (n,) int64: value_codes(n), n the number of values sampled from

    @classmethod
    def of(cls, key: int, batch: int, n_slots: int, n_values: int, device) -> "SlotNoise":
        rows = mix32(torch.tensor(key, device=device) ^ torch.arange(batch, device=device))[:, None]
        return cls(mix32(rows ^ torch.arange(n_slots, device=device)), value_codes(n_values, device))


def filtered_probs(logits: torch.Tensor, temperature, top_k: int | None, top_p) -> torch.Tensor:
    """logits (..., V) -> probabilities after temperature, top-k and top-p (None: off). temperature and top_p:
    floats or 0-d tensors (the compiled step's: a Python float would become a CPU input of the graph, and a
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
    return logits.softmax(-1)


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None, key: torch.Tensor | None = None) -> torch.Tensor:
    """logits (..., V) -> token ids (...). temperature 0 or top_k 1 is greedy.
    key (...) int64: the noise of each row is `keyed_exponential(key)` (the samplers' reproducible draw);
    without it the noise comes from `generator` (torch's global RNG if None)."""
    if temperature <= 0 or top_k == 1:
        return logits.argmax(-1)
    probs = filtered_probs(logits, temperature, top_k, top_p if top_p is not None and top_p < 1.0 else None)
    # exponential race = multinomial sampling without a host sync (gpt-fast)
    if key is not None:
        race = keyed_exponential(key, probs.shape[-1])
    else:
        race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(-1)


def sample_slots(logits: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, codes: torch.Tensor,
                 temperature: torch.Tensor | None, top_k: int | None, top_p: torch.Tensor | None,
                 codebook_size: int | None) -> torch.Tensor:
    """(B, O, V) logits of the outputs predicting `slots` (O,) -> (B, O) image token ids; temperature None:
    greedy. keys, codes: a `SlotNoise`'s; the noise of output (b, o) is keyed by (seed, b, slots[o]): the same
    whichever pass or padding produced it. Image slots take image codes only (a slice, not a mask: ids below
    codebook_size keep theirs)."""
    if codebook_size is not None:
        logits = logits[..., :codebook_size]
    if temperature is None:
        return logits.argmax(-1)
    probs = filtered_probs(logits, temperature, top_k, top_p)
    race = keyed_exponential(keys[:, slots], probs.shape[-1], codes)
    return (probs / race).argmax(-1)


# ---- static shapes ----------------------------------------------------------------------------------------
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


@dataclass
class Bucket:
    """Passes padded to one shape: P passes, W input rows, O sampled outputs, a cache prefix of n slots."""

    src: torch.Tensor  # (P, W) long: token column of each input row (padding: 0)
    coords: torch.Tensor  # (P, W, 4) long
    mask: torch.Tensor  # (P, 1, W, n+W) bool: [cache slots 0..n-1 | this pass's (padded) inputs]
    cache_pos: torch.Tensor  # (P, W) long: cache slot written (proxies, padding: the scratch slot N)
    out_rows: torch.Tensor  # (P, O) long: rows sampled (padding: row 0)
    out_slots: torch.Tensor  # (P, O) long: token column written (padding: the dummy column N)

    def step_args(self, i: int) -> tuple:
        """Pass i's step inputs, copies: a view would make torch.compile guard on the bucket's pass count."""
        return tuple(t[i].clone() for t in (self.src, self.coords, self.mask, self.cache_pos, self.out_rows,
                                            self.out_slots))


@dataclass
class StaticPlan:
    buckets: list[Bucket]
    passes: list[tuple]  # per pass after the prefill, in order: its `Bucket.step_args`
    real_rows: float  # mean input rows per pass before padding
    real_cols: float  # mean visible cache slots per pass (PassPlan.n_vis) before padding

    @property
    def rows_per_pass(self) -> float:
        return sum(a[0].shape[-1] for a in self.passes) / max(len(self.passes), 1)

    @property
    def cache_cols_per_pass(self) -> float:
        return sum(a[2].shape[-1] - a[2].shape[-2] for a in self.passes) / max(len(self.passes), 1)


def bucket_plans(plans: list[PassPlan], n_slots: int, widths: int, vis_step: int, dev) -> StaticPlan:
    """Group PassPlans (all but the prefill) by (width class, cache prefix // vis_step) and pad each group to
    one shape; nothing here knows the schedule's rules."""
    N = n_slots
    allowed = pass_widths([len(p.src) for p in plans], widths)
    groups: dict[tuple[int, int], list[int]] = {}
    for s, p in enumerate(plans):
        width = next(w for w in allowed if w >= len(p.src))
        groups.setdefault((width, -(-p.n_vis // vis_step)), []).append(s)
    where = [None] * len(plans)
    buckets = []
    for (W, _), members in groups.items():
        n = max(plans[s].n_vis for s in members)
        O = max(max(plans[s].n_out for s in members), 1)
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
    return StaticPlan(buckets, [buckets[g].step_args(i) for g, i in where],
                      real_rows=sum(len(p.src) for p in plans) / max(len(plans), 1),
                      real_cols=sum(p.n_vis for p in plans) / max(len(plans), 1))


def forward_rows(model, tokens, src, coords, mask, cache_pos, out_rows):
    """One pass: (B, N+1) tokens -> (B, O, V) logits of the sampled rows."""
    return model(tokens[:, src], coords, mask, cache_pos)[:, out_rows]


def _sample_pass(model, tokens, src, coords, mask, cache_pos, out_rows, out_slots, keys, codes, temperature, top_k,
                 top_p, codebook_size):
    """One pass, sampled: -> (B, O) token ids for `out_slots` (the caller writes them: CUDA graphs do not
    take a mutated input other than the cache buffers)."""
    logits = forward_rows(model, tokens, src, coords, mask, cache_pos, out_rows)
    return sample_slots(logits, out_slots, keys, codes, temperature, top_k, top_p, codebook_size)


# dynamic: bucket shapes differ by design; one symbolic trace serves them all (a few more for sizes 1), and
# CUDA graph trees record one graph per bucket shape. dynamic=False would recompile the model per bucket.
COMPILE_OPTIONS = dict(mode="reduce-overhead", dynamic=True)
# CPU (no CUDA graphs): inductor's C++ wrapper calls the pass's kernels without a line of Python each; at batch 1 a
# pass is mostly per-kernel overhead (mcar.play on the shipped model: 1.6x, BENCHMARKS.md)
CPU_COMPILE_OPTIONS = dict(dynamic=True, options={"cpp_wrapper": True})


def _compiled(fn, device):
    # compiled from a copy of fn's code: dynamo keeps graphs, and its limit of 8 recompiles, per code object, and
    # each sampler adds a few (sizes 1, top-k/top-p on or off): samplers sharing one would run out
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return torch.compile(own, **(COMPILE_OPTIONS if torch.device(device).type == "cuda" else CPU_COMPILE_OPTIONS))


@dataclass
class TeacherForced:
    slots: torch.Tensor  # (n_gen,) long: the generated slots, in layout order
    nll: torch.Tensor  # (B, n_gen) float32: cross-entropy of each generated token
    logits: torch.Tensor | None  # (B, n_gen, V) float32, when asked for


class ScheduleSampler:
    """Generates on a schedule: DiagD (`schedule`, a ScheduleConfig or its fields as keywords) or NTP
    (`ScheduleSampler.ntp`: the raster schedule k = w, d = h*w, one image token per pass). prompt_frames, when
    given, overrides the schedule's."""

    def __init__(self, layout: Layout, frames: int, prompt_frames: int | None = None, *,
                 schedule: ScheduleConfig | dict | None = None, name: str = "diagd", temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 static: bool = False, compile: bool | str = False, static_widths: int = 3,
                 codebook_size: int | None = None, **schedule_fields):
        if temperature < 0:
            raise ValueError(f"temperature={temperature} is invalid: it must be >= 0 (0 = greedy)")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k} is invalid: it must be >= 1 or null (off)")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p} is invalid: it must be in (0, 1] or null (off)")
        if codebook_size is not None and codebook_size < 1:
            raise ValueError(f"codebook_size={codebook_size} is invalid: it must be >= 1 or null (whole vocabulary)")
        if compile not in (True, False, "auto"):
            raise ValueError(f"compile={compile!r} is invalid: choose true, false or auto (on for CUDA)")
        if static_widths < 1:
            raise ValueError(f"static_widths={static_widths} is invalid: it must be >= 1")
        self.config = ScheduleConfig.of(schedule, prompt_frames=prompt_frames, **schedule_fields)
        self.name, self.layout, self.frames, self.full = name, layout, frames, self.config.full
        # image slots may only take image codes: ids >= codebook_size are action tokens (an undertrained model
        # would otherwise write action ids into frames); None samples from the whole vocabulary
        self.codebook_size = codebook_size
        self.prompt_frames = self.config.prompt_frames
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
        self.static, self.static_widths = static, static_widths
        self.compile = compile if compile == "auto" else bool(compile)
        self._schedules: dict[int, Schedule] = {}
        self._static: dict = {}  # (prompt_frames, device) -> StaticPlan
        self._compiled: dict = {}  # plain step function -> its torch.compile wrapper
        sched = self.schedule(self.prompt_frames)  # validate now, at config time
        if self.full:
            sched.check_full()

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
        # one key per (batch row, slot), the dummy column N included
        noise = SlotNoise.of(seed_key(self.seed), clip.shape[0], clip.shape[1] + 1, n_values, clip.device)
        rule = self._rule(clip.device)
        if self.is_static(clip.device):
            tokens, passes = self._generate_static(model, clip, sched, setup_cache, noise, rule)
        else:
            tokens, passes = clip.clone(), 0
            for p, logits in self._passes(model, tokens, sched, setup_cache):
                passes += 1
                if p.n_out:
                    tokens[:, p.out_slots] = sample_slots(logits[:, p.out_rows], p.out_slots, noise.keys,
                                                          noise.codes, *rule)
        if tokens.is_cuda:
            torch.cuda.synchronize(tokens.device)
        return tokens, SampleStats(passes, tokens.shape[0] * len(sched.gen_slots), time.perf_counter() - t0)

    def _rule(self, device) -> tuple:
        """sample_slots' (temperature, top_k, top_p, codebook_size): None for what is off, floats as tensors."""
        if self.temperature <= 0 or self.top_k == 1:
            return None, None, None, self.codebook_size
        top_p = torch.tensor(self.top_p, device=device) if self.top_p is not None and self.top_p < 1 else None
        return torch.tensor(float(self.temperature), device=device), self.top_k, top_p, self.codebook_size

    def static_plan(self, sched: Schedule, device) -> StaticPlan:
        key = (sched.prompt_frames, str(device))
        if key not in self._static:
            vis_step = self.layout.frame_len * -(-(self.frames - sched.prompt_frames) // MAX_PREFIX_CLASSES)
            self._static[key] = bucket_plans(sched.plan(self.full, device)[1:], sched.n_slots, self.static_widths,
                                             vis_step, device)
        return self._static[key]

    def step_fn(self, fn, device):
        """`fn` (a per-pass step) as generate() on `device` runs it: compiled once per sampler, or plain."""
        if not self.compiles(device):
            return fn
        if fn not in self._compiled:
            self._compiled[fn] = _compiled(fn, device)
        return self._compiled[fn]

    def _generate_static(self, model, clip, sched, setup_cache, noise, rule):
        """Prefill (pass 0) eagerly, then every other pass through its bucket's static-shape (compiled) step."""
        st = self.static_plan(sched, clip.device)
        step = self.step_fn(_sample_pass, clip.device)
        check_clip(clip, self.layout, self.frames)
        self._open_cache(model, clip.shape[0], sched, setup_cache, clip.device)
        tokens = torch.cat([clip, clip[:, :1]], dim=1)  # (B, N+1): column N takes padded outputs
        p = sched.plan(self.full, clip.device)[0]  # the prefill, eager
        logits = model(tokens[:, p.src], p.coords, p.mask, p.cache_pos)[:, p.out_rows]
        tokens[:, p.out_slots] = sample_slots(logits, p.out_slots, noise.keys, noise.codes, *rule)
        for args in st.passes:
            tokens[:, args[-1]] = step(model, tokens, *args, noise.keys, noise.codes, *rule)
        return tokens[:, :-1].clone(), 1 + len(st.passes)

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
        cache = model.layers[0].attention.cache
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


def diagd_val_loss(model, sampler: ScheduleSampler, clip: torch.Tensor, prompt_frames: int | None = None):
    """Teacher-forced DiagD validation loss: mean cross-entropy over the generated image tokens."""
    return sampler.teacher_forced(model, clip, prompt_frames, keep_logits=False).nll.mean()


SAMPLERS = ("ntp", "diagd")


def build_sampler(cfg, layout: Layout, frames: int, codebook_size: int | None = None,
                  schedule: ScheduleConfig | dict | None = None) -> ScheduleSampler:
    """sampler=<name> (a dict or DictConfig of the sampler group) on the run's `schedule` (the schedule group)
    -> a sampler for clips of `frames` frames. codebook_size (the data's): image slots sample image codes only.
    compile: auto is resolved per device at generate time (`ScheduleSampler.compiles`)."""
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
    if name == "ntp":
        return ScheduleSampler.ntp(layout, frames, schedule=schedule, **kw)
    return ScheduleSampler(layout, frames, schedule=schedule, **kw)
