"""Speed measurements behind `mcar bench sampler|train` (mcar/tools/bench.py), on random weights.

sampler: generate frames prompt_frames..T-1 of a random clip with the configured sampler (batch
bench.batch_size), median over bench.repeats after bench.warmup runs; also times the bare model forwards of the
same passes (same inputs, same cache, no gathering or sampling) to measure the sampler's own overhead
(bench.bare_forward: auto skips them where the sampler's step is compiled, since they would compile whole-model
graphs of their own).
bench.compare=true runs NTP and the configured DiagD in one process and adds speedup and pass_ratio.
train: forward + backward + optimiser steps (conf/optim) on random clips under the configured mask; tokens/s,
ms/step, peak memory and (GPU) MFU, and the data loader's time per step. memory and gpu: see mcar/bench/gpu_check.py.

"""
from __future__ import annotations

import functools
import os
import resource
import statistics
import sys
import time

import torch
from omegaconf import DictConfig, OmegaConf

from mcar.core.devices import resolve_device, set_threads, sync
from mcar.core.flops import bandwidth_of, mfu, peak_flops, train_step_flops
from mcar.core.layout import Layout
from mcar.core.masks import build_mask_factory, masked_loss
from mcar.core.model import ModelConfig, Transformer
from mcar.core.precision import compute_dtype
from mcar.core.sampler import build_sampler, forward_rows
from mcar.hydra_app import to_dict


def timed(fn, device: torch.device, warmup: int, repeats: int, label: str | None = None):
    """(median seconds of fn() over `repeats` runs after `warmup` untimed ones, the last run's result). With a label,
    each run prints a progress line to stderr (a CPU run of a long clip takes minutes)."""
    times, result = [], None
    for i in range(warmup + repeats):
        sync(device)
        t0 = time.perf_counter()
        result = fn()
        sync(device)
        seconds = time.perf_counter() - t0
        if i >= warmup:
            times.append(seconds)
        if label:
            run = f"warm-up {i + 1}/{warmup}" if i < warmup else f"run {i + 1 - warmup}/{repeats}"
            print(f"bench {label}: {run} took {seconds:.1f} s", file=sys.stderr, flush=True)
    return statistics.median(times), result


def setup(cfg: DictConfig):
    b = cfg.bench
    device = resolve_device(b.device)
    dtype = compute_dtype(device) if b.dtype == "auto" else getattr(torch, b.dtype)
    set_threads(b.threads)
    torch.manual_seed(cfg.seed)
    layout = Layout.of(cfg.data)
    model = Transformer(ModelConfig(**to_dict(cfg.model.arch))).to(device)
    return device, dtype, layout, model


def common_fields(cfg, device, dtype, model) -> dict:
    return dict(model=cfg.model.name, params=model.num_params(), device=str(device),
                device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                threads=torch.get_num_threads(), dtype=str(dtype).removeprefix("torch."),
                batch_size=int(cfg.bench.batch_size), load_avg_1m=round(os.getloadavg()[0], 2))


# ---- sampler ----------------------------------------------------------------------------------------------
# peak memory bandwidth (B/s) by device name: every name fragment must match, first row wins
def peak_bandwidth(device: torch.device, override: float | None = None) -> float | None:
    """bench.bandwidth if set, else mcar.core.flops' table's value for a known GPU; None on CPU or an unknown GPU."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    return bandwidth_of(torch.cuda.get_device_name(device))


def bench_sampler(model, sampler, clip: torch.Tensor, prompt_frames: int, cfg, device) -> dict:
    """Time one sampler on `clip` (B, N); the bare forwards run the same passes' inputs through the model.

    fps = fps_total: frames generated per second over the whole batch; fps_per_stream = fps_total / B.
    rows_per_pass / visible_cols_per_pass: the schedule's own rows and visible cache slots (n_vis) per pass;
    padded_rows_per_pass / cache_cols_per_pass: what this path runs (the static path pads to its buckets).
    bytes_per_pass: what a pass must read: the weights (less the embedding table, of which it reads a few rows)
    + K and V of its visible cache slots; floor_ms_per_pass: those bytes at the device's peak bandwidth (the time
    no pass can beat); bandwidth_fraction: bytes_per_pass per ms_per_pass over the device's peak bandwidth
    (bench.bandwidth, else a table of GPUs; null on CPU). All means over every pass, prefill too.
    """
    b, sched = cfg.bench, sampler.schedule(prompt_frames)
    t0 = time.perf_counter()
    plans = sched.plan(sampler.full, device)  # built once, cached by the schedule
    static = sampler.static_plan(sched, device) if sampler.is_static(device) else None
    plan_seconds = time.perf_counter() - t0
    bare = bare_forward_timing(sampler, device, OmegaConf.select(cfg, "bench.bare_forward", default="auto"))
    sampler.generate(model, clip, prompt_frames)  # sets the cache up; later runs reuse it (zeroed in place)
    seconds, (_, stats) = timed(lambda: sampler.generate(model, clip, prompt_frames, setup_cache=False), device,
                                b.warmup, b.repeats, label=f"sampler {sampler.name}")
    calls = pass_calls(model, sampler, sched, clip, plans)  # builds no graph: a compiled forward compiles when run
    bare_seconds = (timed(bare_forwards(model, calls), device, b.warmup, b.repeats,
                          label=f"{sampler.name} bare forwards")[0] if bare == "timed" else None)
    costs = pass_costs(model, calls, device, b.repeats) if b.pass_costs else None
    B, frames, n = clip.shape[0], sampler.frames - prompt_frames, len(plans)
    bytes_per_pass = _bytes_per_pass(model, sum(p.n_vis for p in plans), n, B)
    peak = peak_bandwidth(device, OmegaConf.select(cfg, "bench.bandwidth", default=None))
    return dict(**_schedule_fields(sampler, sched, static, device, prompt_frames, plans, calls, stats.passes),
                **_throughput_fields(B, frames, n, seconds, stats, bytes_per_pass, peak, bare_seconds),
                bare_forward=bare, plan_seconds=round(plan_seconds, 3), pass_costs=costs)


def _bytes_per_pass(model, cols: int, n: int, B: int) -> float:
    """What a pass must read: the weights (less the embedding table, of which it reads a few rows) + K and V of its
    visible cache slots (`cols` over `n` passes)."""
    m, item = model.cfg, next(model.parameters()).element_size()
    weight_bytes = (model.num_params() - model.tok_embeddings.weight.numel()) * item
    kv_bytes_per_slot = m.n_layers * 2 * m.n_kv_heads * m.head_dim * item * B
    return weight_bytes + kv_bytes_per_slot * cols / n


def _schedule_fields(sampler, sched, static, device, prompt_frames: int, plans: list, calls: list,
                     passes: int) -> dict:
    """What the schedule runs: its shape, its passes and their rows and cache columns (own and padded)."""
    n = len(plans)
    rows, cols = sum(len(p.src) for p in plans), sum(p.n_vis for p in plans)
    run_rows, run_cols = sum(c[2] for c in calls), sum(c[3] for c in calls)
    return dict(sampler=sampler.name, k=sched.k, d=sched.d, proxy=sched.proxy,
                static=sampler.is_static(device), compile=sampler.compiles(device),
                buckets=len(static.buckets) if static is not None else None,
                h=sampler.layout.h, w=sampler.layout.w, n_a=sampler.layout.n_a, clip_frames=sampler.frames,
                prompt_frames=prompt_frames, frames_generated=sampler.frames - prompt_frames, passes=passes,
                schedule_passes=sched.passes, rows_per_pass=round(rows / n, 2),
                padded_rows_per_pass=round(run_rows / n, 2), visible_cols_per_pass=round(cols / n, 1),
                cache_cols_per_pass=round(run_cols / n, 1))


def _throughput_fields(B: int, frames: int, n: int, seconds: float, stats, bytes_per_pass: float, peak,
                       bare_seconds) -> dict:
    """Frames and tokens per second, time per pass against its bandwidth floor, overhead over the bare forwards."""
    s_per_pass = seconds / stats.passes
    return dict(tokens_generated=stats.tokens, seconds=round(seconds, 6), fps=round(B * frames / seconds, 3),
                fps_total=round(B * frames / seconds, 3), fps_per_stream=round(frames / seconds, 3),
                tokens_per_s=round(stats.tokens / seconds, 1), ms_per_pass=round(1000 * s_per_pass, 3),
                bytes_per_pass=round(bytes_per_pass), bandwidth=peak,
                floor_ms_per_pass=round(1000 * bytes_per_pass / peak, 4) if peak else None,
                bandwidth_fraction=round(bytes_per_pass / s_per_pass / peak, 4) if peak else None,
                bare_forward_ms_per_pass=round(1000 * bare_seconds / n, 3) if bare_seconds else None,
                overhead=round(seconds / bare_seconds, 3) if bare_seconds else None)


def bare_forward_timing(sampler, device, setting) -> str:
    """bench.bare_forward (true, false, or auto: timed unless the sampler's step is compiled, as the bare forward is
    another function, so another whole-model compile, ~1 min per graph for 700m on an H100 host) -> "timed" or why
    not (the JSON's bare_forward)."""
    if setting not in (True, False, "auto"):
        raise ValueError(f"bench.bare_forward={setting!r} is invalid: choose true, false or auto (skipped where the "
                         f"sampler's step is compiled)")
    if setting is False:
        return "skipped: bench.bare_forward=false"
    if setting == "auto" and sampler.compiles(device):
        return ("skipped: the sampler's step is compiled and the bare forwards would compile whole-model graphs of "
                "their own (bench.bare_forward=true times them anyway)")
    return "timed"


def pass_calls(model, sampler, sched, clip, plans):
    """The sampler's passes as model forwards alone (`forward_rows`, the sampler's own pass): [(forward, args,
    rows, cache columns)], nothing sampled. A static sampler's passes after the prefill run at their buckets' shapes
    through its own (compiled) forward step; rows and columns are then the padded ones it runs."""
    eager = functools.partial(forward_rows, model)
    calls = [(eager, (clip, p), len(p.src), p.n_vis) for p in plans]
    if sampler.is_static(clip.device):
        forward = functools.partial(sampler.step_fn(forward_rows, clip.device), model)
        tokens = torch.cat([clip, clip[:, :1]], dim=1)  # (B, N+1) as the static sampler has it
        calls = calls[:1] + [(forward, (tokens, p), p.src.shape[-1], p.mask.shape[-1] - p.mask.shape[-2])
                             for p in sampler.static_plan(sched, clip.device).passes]
    return calls


def bare_forwards(model, calls):
    @torch.no_grad()
    def run():
        model.reset_cache()
        for forward, args, _, _ in calls:
            forward(*args)

    return run


@torch.no_grad()
def pass_costs(model, calls, device, repeats: int) -> dict:
    """Each pass timed on its own (median over `repeats` runs of the whole sequence, the first one untimed),
    then fit_pass_costs. What a pass costs per row it feeds bounds DiagD's speedup (fewer passes, more rows
    each) where a pass is compute-bound, as on a CPU."""
    times = []
    for r in range(repeats + 1):
        model.reset_cache()
        run = []
        for forward, args, _, _ in calls:
            sync(device)
            t0 = time.perf_counter()
            forward(*args)
            sync(device)
            run.append(1000 * (time.perf_counter() - t0))
        if r:
            times.append(run)
    ms = torch.tensor(times, dtype=torch.float64).median(dim=0).values
    return fit_pass_costs(ms.tolist(), [c[2] for c in calls], [c[3] for c in calls])


def fit_pass_costs(ms: list[float], rows: list[int], cols: list[int]) -> dict:
    """Least squares over the passes after the first (the prefill, reported alone):
    ms = fixed_ms + ms_per_row * rows + us_per_col / 1000 * cache columns; ms_per_row is null when every
    such pass has the same rows (nothing to fit it from), us_per_col likewise. ms_by_rows: median ms per width."""
    t = torch.tensor(ms[1:], dtype=torch.float64)
    r, c = (torch.tensor(v[1:], dtype=torch.float64) for v in (rows, cols))
    terms = {"fixed": torch.ones_like(r), "row": r, "col": c}
    names = ["fixed"] + [n for n in ("row", "col") if len(set(terms[n].tolist())) > 1]
    X = torch.stack([terms[n] for n in names], dim=1)
    solution = torch.linalg.lstsq(X, t[:, None], driver="gelsd").solution[:, 0]
    coef = dict(zip(names, solution.tolist()))
    ss_res, ss_tot = ((t - X @ solution) ** 2).sum().item(), ((t - t.mean()) ** 2).sum().item()
    by_rows = {str(int(w)): round(statistics.median(t[r == w].tolist()), 3) for w in sorted(set(r.tolist()))}
    return dict(prefill_ms=round(ms[0], 3), prefill_rows=int(rows[0]), fixed_ms=round(coef["fixed"], 3),
                ms_per_row=round(coef["row"], 4) if "row" in coef else None,
                us_per_col=round(1000 * coef["col"], 4) if "col" in coef else None,
                r2=round(1 - ss_res / ss_tot, 4) if ss_tot > 0 else None, ms_by_rows=by_rows,
                mean_ms=round(sum(ms) / len(ms), 3))


def run_sampler(cfg: DictConfig) -> dict:
    device, dtype, layout, model = setup(cfg)
    model = model.to(dtype).eval()
    frames, b = int(cfg.data.clip_frames), cfg.bench
    scfg, schedule = to_dict(cfg.sampler), to_dict(cfg.schedule)
    P = int(b.prompt_frames or schedule["prompt_frames"])
    schedule["prompt_frames"] = P
    clip = torch.randint(0, int(cfg.data.vocab_size), (int(b.batch_size), layout.n_slots(frames)), device=device)
    cb = OmegaConf.select(cfg, "data.codebook_size", default=None)
    out = common_fields(cfg, device, dtype, model)
    if not b.compare:
        return out | bench_sampler(model, build_sampler(scfg, layout, frames, cb, schedule), clip, P, cfg, device)
    if scfg["name"] != "diagd":
        raise ValueError(f"bench.compare=true compares NTP with DiagD: use sampler=diagd, not {scfg['name']!r}")
    ntp = out | bench_sampler(model, build_sampler(scfg | {"name": "ntp"}, layout, frames, cb, schedule), clip, P,
                              cfg, device)
    diag = bench_sampler(model, build_sampler(scfg, layout, frames, cb, schedule), clip, P, cfg, device)
    speedup, pass_ratio = ntp["seconds"] / diag["seconds"], ntp["passes"] / diag["passes"]
    return out | diag | dict(ntp=ntp, ntp_seconds=ntp["seconds"], diagd_seconds=diag["seconds"],
                             speedup=round(speedup, 3), pass_ratio=round(pass_ratio, 3),
                             speedup_over_pass_ratio=round(speedup / pass_ratio, 3),
                             # the same ratio for the bare forwards: what a sampler without overhead would reach
                             bare_speedup_over_pass_ratio=round(ntp["bare_forward_ms_per_pass"]
                                                                / diag["bare_forward_ms_per_pass"], 3)
                             if diag["bare_forward_ms_per_pass"] else None)


# ---- train ------------------------------------------------------------------------------------------------
def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # the process's peak RSS (Linux: KiB)


def run_train(cfg: DictConfig) -> dict:
    from mcar.train.module import build_optimizer  # imports Lightning: not for the sampler's start-up

    device, dtype, layout, model = setup(cfg)
    frames, b = int(cfg.data.clip_frames), cfg.bench
    mcfg = to_dict(cfg.mask)
    factory = build_mask_factory(mcfg.pop("name"), layout, frames, schedule=to_dict(cfg.schedule), **mcfg)
    clip = torch.randint(0, int(cfg.data.vocab_size), (int(b.batch_size), layout.n_slots(frames)), device=device)
    batch = factory(clip)
    # the training's optimiser (conf/optim), built as training builds it: its parameter groups, its fused rule
    opt = build_optimizer(model, to_dict(cfg.optim), fp16=dtype == torch.float16)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step():
        with autocast:
            logits = model(batch.tokens, batch.coords, batch.mask)  # (B, S, V)
            loss = masked_loss(logits, batch.targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, _ = timed(step, device, b.warmup, b.repeats, label=f"train {factory.name}")
    S = batch.tokens.shape[1]
    tokens = clip.numel()  # clip tokens per step (proxy rows are extra inputs, not extra data)
    density = factory.table().dense().float().mean().item()
    cfg_m = model.cfg  # every computed row counts: DiagD's proxy rows too (mcar.core.flops)
    flops = train_step_flops(model.num_params(embeddings=False), cfg_m.n_layers, cfg_m.dim, S, clip.shape[0], density)
    u = mfu(flops, seconds, peak_flops(device, b.peak_flops))
    return common_fields(cfg, device, dtype, model) | dict(
        mask=factory.name, h=layout.h, w=layout.w, n_a=layout.n_a, clip_frames=frames, seq_len=S,
        mask_density=round(density, 4), ms_per_step=round(1000 * seconds, 2), tokens_per_s=round(tokens / seconds, 1),
        peak_memory_mb=round(peak_memory_mb(device), 1),
        mfu=round(u, 4) if u is not None else None) | bench_data(cfg)


def bench_data(cfg: DictConfig) -> dict:
    """The configured datamodule's train loader as Lightning builds it (bench.batch_size clips a step): the
    median wait for the next batch in the main process. Warm-up also drains what the loader workers prefetched,
    so with workers this is their steady-state time per batch: below ms_per_step, input never holds training up."""
    from mcar.data.common import build_datamodule  # imports Lightning: not for the sampler's start-up

    b = cfg.bench
    dm = build_datamodule(cfg.data, batch_size=int(b.batch_size))
    dm.prepare_data()
    dm.setup("fit")
    loader = dm.train_dataloader()
    batches = iter(loader)
    prefetched = loader.num_workers * (loader.prefetch_factor or 0)
    seconds, _ = timed(lambda: next(batches), torch.device("cpu"), int(b.warmup) + prefetched, int(b.repeats))
    batches = loader = None  # ends the loader workers before anything else runs
    return dict(data_ms_per_step=round(1000 * seconds, 3), data_workers=dm.loader_workers(),
                data_clips=len(dm.train_source))
