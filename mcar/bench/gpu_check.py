"""`mcar bench memory|gpu` (mcar/tools/bench.py): the planned training memory, and the one check a GPU machine
runs first.

memory: the peak memory per device that the configured training step will need (mcar.train.memory), the largest batch
that fits bench.memory.budget_gib with and without activation checkpointing, and a whole-model measurement on
fake tensors as a cross-check.

gpu: the check a GPU machine runs first, `mcar bench gpu` (every stage in this process, then the merge), or one
stage (`bench.gpu.stage=<name>`) writing its own JSON into bench.gpu.dir and `bench.gpu.stage=merge` joining them
into bench_gpu.{json,md} with the targets. Each stage JSON records the fingerprint of what it measured (model,
overrides, tiny or not, torch, device); merge refuses stages of different fingerprints. `bench.gpu.stage=list`
prints each stage's state for this run (done, stale: measured by another run, or missing): scripts/gpu_check.sh
runs the stages not done, one process each under a timeout.
Stages:
- train_<mask> (causal, diagd), and train_<variant> for each of bench.gpu.variants (a mask and overrides: the
  training-speed route, e.g. no activation checkpointing with gradient accumulation, flex's USE_TMA): train.py's
  own path (Lightning, the configured trainer, precision, activation checkpointing, per-block compile on CUDA with
  static shapes) for bench.gpu.steps steps: ms/step over the timed window, tokens/s, MFU over the rows the mask
  computes, peak allocated and reserved memory, host syncs per step (CUDA's sync debug mode), graphs compiled;
- flex: flex attention with the DiagD BlockMask against SDPA with the dense mask, in the training dtype;
- sampler_<ntp|diagd>_<F>f: the sampler speed check at F frames (compiled on CUDA): ms/pass against the bandwidth
  floor, frames/s; it compiles the generation step alone (no bare-forward graphs: bench.bare_forward=auto);
- play: steady play as the server runs it, `bench.gpu.play_sessions` games as the rows of one rolling rollout at
  context `bench.gpu.play_context` (compiled on CUDA): each session's and all sessions' frames/s, p50 / p95 ms from
  an action to its frame, against play's bandwidth floor (mcar.core.flops.play_floor); the goals' session counts;
- play_more: the same for `bench.gpu.play_more_sessions`, and each session count whose keys the sampler splits
  (split-KV) timed again unsplit;
- memory: the planned training peak of each train stage's shape against its measured peaks.
`bench.gpu.stage=all` (the default) runs every stage in this process (torch.compiler.reset() between). With
data=synthetic and logger=csv it imports none of wandb, av, diffusers, crafter.
"""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import torch
from hydra import compose
from omegaconf import DictConfig, OmegaConf, open_dict

from mcar.atomic import write_atomic, write_json
from mcar.bench.speed import peak_bandwidth, run_sampler, setup
from mcar.core.devices import resolve_device, sync
from mcar.core.flops import mfu, peak_flops, play_floor
from mcar.core.latency import latency_summary
from mcar.core.layout import Layout
from mcar.core.masks import build_mask_factory
from mcar.core.model import ModelConfig, Transformer
from mcar.core.precision import compute_dtype
from mcar.hydra_app import command_line_overrides, to_dict


def training_shape(cfg: DictConfig) -> dict:
    """What the memory plan needs from a training config: sequence rows (the mask's input sequence), batch,
    precision, activation checkpointing, FSDP devices."""
    layout = Layout.of(cfg.data)
    mcfg = to_dict(cfg.mask)
    factory = build_mask_factory(mcfg.pop("name"), layout, int(cfg.data.clip_frames), schedule=to_dict(cfg.schedule),
                                 **mcfg | {"backend": "sdpa"})
    seq_len = int(factory(torch.zeros(1, layout.n_slots(int(cfg.data.clip_frames)), dtype=torch.long)).tokens.shape[1])
    strategy = OmegaConf.select(cfg, "trainer.strategy", default="auto")
    fsdp = isinstance(strategy, DictConfig) and "ModelParallel" in str(strategy.get("_target_", ""))
    return dict(seq_len=seq_len, batch=int(cfg.data.batch_size), bf16=str(cfg.trainer.precision).startswith("bf16"),
                activation_checkpointing=bool(cfg.model.get("activation_checkpointing", False)),
                residual_bf16=str(cfg.get("residual_dtype", "float32")) == "bfloat16",
                fsdp_devices=int(cfg.trainer.devices) * int(cfg.trainer.num_nodes) if fsdp else 1)


def run_memory(cfg: DictConfig) -> dict:
    from mcar.train.memory import GiB, measure_step_peak, plan_training  # imports FSDP (~1 s): not at every start-up

    shape = training_shape(cfg)
    m = cfg.bench.memory
    t0 = time.perf_counter()
    out = {"model": cfg.model.name, "clip_frames": int(cfg.data.clip_frames), "mask": cfg.mask.name} | \
        plan_training(to_dict(cfg.model.arch), shape["seq_len"], shape["batch"], bf16=shape["bf16"],
                      activation_checkpointing=shape["activation_checkpointing"],
                      fsdp_devices=shape["fsdp_devices"], budget_gib=m.budget_gib,
                      residual_bf16=shape["residual_bf16"])
    if m.direct and shape["fsdp_devices"] == 1:
        peak = measure_step_peak(ModelConfig(**to_dict(cfg.model.arch)), shape["batch"], shape["seq_len"],
                                 torch.bfloat16 if shape["bf16"] else None, shape["activation_checkpointing"],
                                 residual_dtype=torch.bfloat16 if shape["bf16"] and shape["residual_bf16"] else None)
        out["direct_fake_peak_gib"] = round(peak / GiB, 3)
    return out | {"plan_seconds": round(time.perf_counter() - t0, 1)}


# ---- gpu ----------------------------------------------------------------------------------------------------
class StepTimes:
    """Training steps after the warm-up ones, timed as one window (device synchronised at its two ends only, so
    the host runs ahead as in a real run): ms/step = window / steps. On CUDA the window runs under the sync debug
    mode, which warns at every host sync: their count per step is reported. Lightning's hooks, made a Callback
    where used (`step_times`): Lightning is imported by the train stages only, ~5 s less start-up for the others."""

    def __init__(self, warmup: int):
        self.warmup, self.steps, self.syncs, self.seconds = warmup, 0, None, None
        self._t0, self._caught, self._recorded = None, None, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.warmup and self._t0 is None:
            sync(pl_module.device)
            self._t0 = time.perf_counter()
            if pl_module.device.type == "cuda":
                self._caught = warnings.catch_warnings(record=True)
                self._recorded = self._caught.__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
        if trainer.global_step == 0:
            self.batch_size = len(batch["tokens"])
            self.tokens = batch["tokens"].numel() * trainer.world_size
            self.step_flops = pl_module.step_flops(self.batch_size) * trainer.world_size

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._t0 is not None and self.seconds is None:
            self.steps += 1
            if trainer.global_step >= trainer.max_steps:  # the last step: close the window before teardown
                self._close(pl_module.device)

    def on_train_end(self, trainer, pl_module):
        if self._t0 is not None and self.seconds is None:
            self._close(pl_module.device)

    def _close(self, device):
        if self._caught is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._caught.__exit__(None, None, None)
            self.syncs = sum("synchroniz" in str(w.message) for w in self._recorded)
        sync(device)
        self.seconds = time.perf_counter() - self._t0


def step_times(warmup: int):
    from lightning.pytorch.callbacks import Callback

    return type("StepTimesCallback", (StepTimes, Callback), {})(warmup)


def train_overrides(cfg: DictConfig, mask: str, out: Path, overrides: list[str]) -> list[str]:
    """The bench command's own overrides (experiment, model, data, trainer...) plus what a timing run needs."""
    g = cfg.bench.gpu
    user = [o for o in overrides if not o.split("=")[0].lstrip("+~").startswith("bench.")]
    if not any(o.startswith("data=") for o in user):
        user = [f"data={cfg.data.name}"] + user  # the bench's default data (synthetic), not train.py's
    on_cuda = torch.cuda.is_available() and OmegaConf.select(cfg, "trainer.accelerator") != "cpu"
    compile_ = on_cuda if g.compile == "auto" else bool(g.compile)
    return user + [f"mask={mask}", "logger=csv", f"trainer.max_steps={int(g.steps)}", "trainer.limit_val_batches=0",
                   "val_dashboard.n_clips=0", "checkpoint.every_n_steps=null", "++trainer.enable_progress_bar=false",
                   f"compile={compile_}", f"run_name=gpucheck-{mask}", f"paths.checkpoint_root={out}/ckpt"]


# overrides that change where a stage writes or what merge compares against: not what it measures
NOT_MEASURED = ("bench.gpu.stage", "bench.gpu.dir", "bench.gpu.targets")


def fingerprint(cfg: DictConfig, overrides: list[str]) -> dict:
    """What a stage measured: merge joins only stages of one fingerprint (a tiny CPU run, another model, other
    overrides, another torch or another GPU must not stand in for a stage)."""
    measured = [o for o in overrides if not o.split("=")[0].lstrip("+~").startswith(NOT_MEASURED)]
    return {"model": str(cfg.model.name), "tiny": cfg.model.name == "tiny", "overrides": measured,
            "torch": torch.__version__, "device": device_name()}


def compiled_graphs() -> int:
    """Graphs dynamo compiled in this process so far (each one is a compile: the stage's start-up cost)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def train_check(cfg: DictConfig, name: str, out: Path, overrides: list[str]) -> dict:
    """train_<name>: a mask (causal, diagd) or a variant of bench.gpu.variants (its mask and overrides)."""
    from mcar.train.memory import GiB
    from mcar.train.task import run

    variant = (cfg.bench.gpu.get("variants") or {}).get(name)
    mask, extra = (variant.mask, list(variant.get("overrides") or [])) if variant is not None else (name, [])
    tcfg = compose(config_name="train", overrides=train_overrides(cfg, mask, out, overrides) + extra
                   + [f"run_name=gpucheck-{name}"])
    with open_dict(tcfg):
        tcfg.paths.output_dir = str(out / f"train_{name}")
    timer = step_times(int(cfg.bench.gpu.warmup_steps))
    cuda = torch.cuda.is_available() and tcfg.trainer.accelerator != "cpu"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    metrics = run(tcfg, callbacks=[timer])
    wall = time.perf_counter() - t0
    if not timer.steps:
        raise RuntimeError(f"bench.gpu.steps={cfg.bench.gpu.steps} leaves no timed step after "
                           f"bench.gpu.warmup_steps={cfg.bench.gpu.warmup_steps}")
    step = timer.seconds / timer.steps
    dev = torch.device("cuda" if cuda else "cpu")
    world = int(tcfg.trainer.devices) * int(tcfg.trainer.num_nodes) if cuda else 1
    shape = training_shape(tcfg)
    u = mfu(timer.step_flops, step, peak_flops(dev, tcfg.get("peak_flops")), world)
    return {"mask": mask, "variant": extra or None, "precision": str(tcfg.trainer.precision),
            "compile": bool(tcfg.compile), "accumulate_grad_batches": int(tcfg.trainer.accumulate_grad_batches),
            "activation_checkpointing": shape["activation_checkpointing"], "batch_size": shape["batch"],
            "residual_dtype": str(tcfg.residual_dtype),
            "seq_len": shape["seq_len"], "clip_len": int(tcfg.data.clip_frames) * (int(tcfg.data.h) * int(tcfg.data.w)
                                                                                  + int(tcfg.data.n_a)),
            "timed_steps": timer.steps, "ms_per_step": round(1000 * step, 1),
            "tokens_per_s": round(timer.tokens / step, 1), "tflops_per_s": round(timer.step_flops / step / 1e12, 2),
            "mfu": round(u, 4) if u is not None else None, "mfu_counts": "every computed row (DiagD: + proxy rows)",
            "host_syncs_per_step": round(timer.syncs / timer.steps, 2) if timer.syncs is not None else None,
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GiB, 3) if cuda else None,
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GiB, 3) if cuda else None,
            "compiled_graphs": compiled_graphs(), "final_loss": round(metrics.get("train/loss", float("nan")), 4),
            "wall_seconds": round(wall, 1)}


def flex_check(cfg: DictConfig) -> dict:
    """DiagD mask of the configured clip: flex + BlockMask against SDPA + dense mask, in the training dtype."""
    dev = resolve_device("auto")
    dtype = compute_dtype(dev) if str(cfg.trainer.precision).startswith("bf16") else torch.float32
    bf16 = dtype == torch.bfloat16
    arch = to_dict(cfg.model.arch) | {"n_layers": int(cfg.bench.gpu.flex_layers)}
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**arch)).to(dev, dtype).eval()
    layout, frames = Layout.of(cfg.data), int(cfg.data.clip_frames)
    factory = build_mask_factory("diagd", layout, frames, schedule=to_dict(cfg.schedule), backend="flex")
    batch = factory(torch.randint(0, int(cfg.data.codebook_size), (1, layout.n_slots(frames)), device=dev))
    with torch.no_grad():
        flex = model(batch.tokens, batch.coords, batch.mask)
        dense = model(batch.tokens, batch.coords, factory.table(dev).dense())
    err = ((flex - dense).abs().max() / dense.abs().max()).item()
    tol = 3e-2 if bf16 else 1e-4
    return {"dtype": str(dtype).removeprefix("torch."), "seq_len": int(batch.tokens.shape[1]),
            "max_rel_err": float(f"{err:.3g}"), "argmax_agreement": round((flex.argmax(-1) == dense.argmax(-1))
                                                                          .float().mean().item(), 4),
            "tolerance": tol, "ok": err <= tol, "compiled_graphs": compiled_graphs()}


SAMPLER_KEYS = ("sampler", "k", "clip_frames", "passes", "fps", "ms_per_pass", "bare_forward",
                "bare_forward_ms_per_pass", "overhead", "bytes_per_pass", "bandwidth", "floor_ms_per_pass",
                "bandwidth_fraction", "rows_per_pass", "padded_rows_per_pass", "visible_cols_per_pass",
                "cache_cols_per_pass", "buckets", "dtype", "static", "compile", "device_name")


def sampler_check(cfg: DictConfig, name: str, frames: int) -> dict:
    """One sampler (ntp, or DiagD on the configured schedule) at `frames` frames, as `mcar bench
    sampler` times it; over_floor: ms per pass over the bandwidth floor (bench's floor_ms_per_pass)."""
    scfg = cfg.copy()
    with open_dict(scfg):
        scfg.data.clip_frames = int(frames)
        scfg.bench.compare = False
        scfg.sampler.name = name
    r = run_sampler(scfg)
    floor = r["floor_ms_per_pass"]
    return {k: r.get(k) for k in SAMPLER_KEYS} | {"over_floor": round(r["ms_per_pass"] / floor, 3) if floor else None,
                                                  "compiled_graphs": compiled_graphs()}


@torch.no_grad()
def play_check(cfg: DictConfig, more: bool = False) -> dict:
    """Each of bench.gpu.play_sessions games (`more`: bench.gpu.play_more_sessions) batched as the rows of one
    rolling rollout (the configured sampler and schedule, context bench.gpu.play_context, compiled on CUDA), past
    its warm-up advances: the time of each tick (one advance: every game's action in, its frame out; a frame
    d < s_spa started in_flight ticks earlier arrives after in_flight ticks), synced, over bench.gpu.play_steps
    ticks. `more` also times, with one attention call over the keys (kv_splits=1), every session count of both
    lists whose keys the sampler splits: split-KV's gain where it splits, in the stage the goals do not wait on."""
    from mcar.core.sampler import build_sampler

    g = cfg.bench.gpu
    device, dtype, layout, model = setup(cfg)
    model = model.to(dtype).eval()
    context, cb = int(g.play_context), int(cfg.data.codebook_size)
    sampler = build_sampler(to_dict(cfg.sampler) | {"context": context}, layout, context + 1, cb, to_dict(cfg.schedule))
    plan = sampler.rolling_schedule(device)
    peak = peak_bandwidth(device, OmegaConf.select(cfg, "bench.bandwidth", default=None))
    rate = OmegaConf.select(cfg, "bench.play.deadline_fps", default=None)

    def tick_times(s, n: int) -> torch.Tensor:
        prompt = torch.randint(0, cb, (n, plan.prompt_frames * layout.frame_len), device=device)
        actions = torch.randint(cb, int(cfg.data.vocab_size), (n, layout.n_a), device=device)
        run = s.rollout(model, prompt)
        for _ in range(len(plan.warmup) + int(g.play_warmup)):  # past the warm-up advances; compiles, records graphs
            run.advance(actions)
        ticks = []
        for _ in range(int(g.play_steps)):
            sync(device)
            t0 = time.perf_counter()
            run.advance(actions)
            sync(device)
            ticks.append(time.perf_counter() - t0)
        del run
        model.swap_caches(None)
        return torch.tensor(ticks, dtype=torch.float64)

    rows = {}
    for sessions in (g.play_more_sessions if more else g.play_sessions):
        n = int(sessions)
        t = tick_times(sampler, n)
        floor = play_floor(model.cfg, layout, context, n, peak, sampler.config.k, sampler.config.d,
                           next(model.parameters()).element_size()) if peak else None
        fps = n / float(t.mean())
        # a frame's action-to-frame time: in_flight ticks (docs/speed.md; the model's part: no VQ decode, no PNG)
        latency = latency_summary([plan.in_flight * float(x) for x in t], rate, ndigits=6)
        rows[str(n)] = {"sessions": n, "ms_per_tick": round(1000 * float(t.mean()), 3),
                        "fps_per_session": round(1 / float(t.mean()), 3), "fps_total": round(fps, 3),
                        **{f"p{q}_ms": round(1000 * latency[f"p{q}_s"], 3) for q in (50, 95, 99)},
                        "deadline_attainment": latency.get("deadline_attainment"),
                        "floor_fps_total": round(floor["fps_total"], 3) if floor else None,
                        "of_floor": round(fps / floor["fps_total"], 3) if floor else None,
                        "kv_splits": sampler.kv_splits_for(n, model.cfg.n_kv_heads, device),
                        "ms_per_tick_unsplit": None}
    unsplit_ms = {}
    if more:
        unsplit = build_sampler(to_dict(cfg.sampler) | {"context": context, "kv_splits": 1}, layout, context + 1, cb,
                                to_dict(cfg.schedule))
        for n in sorted({int(n) for n in [*g.play_sessions, *g.play_more_sessions]}):
            if sampler.kv_splits_for(n, model.cfg.n_kv_heads, device) > 1:
                unsplit_ms[str(n)] = round(1000 * float(tick_times(unsplit, n).mean()), 3)
    return {"context": context, "k": sampler.config.k, "d": plan.d, "in_flight": plan.in_flight,
            "compile": sampler.compiles(device), "passes_per_tick": plan.d, "sessions": rows,
            "unsplit_ms_per_tick": unsplit_ms, "compiled_graphs": compiled_graphs()}


def joined_play(play: dict | None, more: dict | None) -> dict | None:
    """The play and play_more stages' results as one: every session count's row, in order, each split one with its
    unsplit time (play_more's) beside it."""
    if not (play or more):
        return None
    rows = {**(play or {}).get("sessions", {}), **(more or {}).get("sessions", {})}
    unsplit = (more or {}).get("unsplit_ms_per_tick", {})
    rows = {n: r | {"ms_per_tick_unsplit": unsplit.get(n)} for n, r in sorted(rows.items(), key=lambda x: int(x[0]))}
    return (play or more) | {"sessions": rows, "unsplit_ms_per_tick": unsplit}


def memory_check(cfg: DictConfig, out: Path) -> dict:
    """The planned training peak (mcar.train.memory) of each train stage's shape against its measured peaks."""
    from mcar.train.memory import plan_training

    shape = training_shape(cfg)
    rows = {}
    for mask in cfg.bench.gpu.masks:
        stage = read_stage(out, f"train_{mask}")
        seq_len = stage["seq_len"] if stage else training_shape(mask_config(cfg, mask))["seq_len"]
        plan = plan_training(to_dict(cfg.model.arch), seq_len, shape["batch"], bf16=shape["bf16"],
                             activation_checkpointing=shape["activation_checkpointing"], budget_gib=None,
                             device=resolve_device("auto").type)
        rows[mask] = {"seq_len": seq_len, "planned_peak_gib": plan["peak_gib"],
                      "peak_allocated_gib": stage.get("peak_allocated_gib") if stage else None,
                      "peak_reserved_gib": stage.get("peak_reserved_gib") if stage else None}
    return rows


def mask_config(cfg: DictConfig, mask: str) -> DictConfig:
    c = cfg.copy()
    with open_dict(c):
        c.mask = compose(config_name="train", overrides=[f"mask={mask}"]).mask
    return c


def stages(cfg: DictConfig) -> list[str]:
    """Every stage, in the order scripts/gpu_check.sh runs them."""
    g = cfg.bench.gpu
    return ([f"train_{m}" for m in g.masks] + [f"train_{v}" for v in (g.get("variants") or {})] + ["flex"]
            + [f"sampler_{n}_{int(f)}f" for f in g.sampler_frames for n in ("ntp", "diagd")]
            + ["play", "play_more", "memory"])


def run_stage(cfg: DictConfig, stage: str, out: Path, overrides: list[str]) -> dict:
    """One stage -> its JSON (out/<stage>.json, with the fingerprint of `overrides`, the command line's)."""
    t0 = time.perf_counter()
    if stage not in stages(cfg):
        raise ValueError(f"bench.gpu.stage={stage!r} is unknown; choose one of {stages(cfg)}, all, merge or list")
    if stage.startswith("train_"):
        result = train_check(cfg, stage.removeprefix("train_"), out, overrides)
    elif stage == "flex":
        result = flex_check(cfg)
    elif stage.startswith("sampler_"):
        _, name, frames = stage.split("_")
        result = sampler_check(cfg, name, int(frames.removesuffix("f")))
    elif stage in ("play", "play_more"):
        result = play_check(cfg, more=stage == "play_more")
    else:
        result = memory_check(cfg, out)
    result = {"stage": stage, "device": device_name(), "date": time.strftime("%Y-%m-%d"), "model": cfg.model.name,
              "torch": torch.__version__, "fingerprint": fingerprint(cfg, overrides),
              "seconds": round(time.perf_counter() - t0, 1), "result": result}
    write_json(out / f"{stage}.json", result)  # whole or not at all: a stage killed while writing runs again
    return result


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def read_stage(out: Path, stage: str) -> dict | None:
    path = out / f"{stage}.json"
    return json.loads(path.read_text())["result"] if path.exists() else None


def stage_states(out: Path, names: list[str], fp: dict) -> dict[str, str]:
    """Each stage: done (its JSON has this fingerprint), stale (a JSON of another fingerprint, or of none) or
    missing."""
    states = {}
    for name in names:
        path = out / f"{name}.json"
        states[name] = "missing" if not path.exists() else \
            "done" if json.loads(path.read_text()).get("fingerprint") == fp else "stale"
    return states


def run_gpu(cfg: DictConfig) -> dict:
    """bench.gpu.stage: one stage (its JSON in bench.gpu.dir), merge, all (every stage, then merge), or list (each
    stage's state for this run's fingerprint; runs nothing)."""
    out = Path(cfg.bench.gpu.dir)
    out.mkdir(parents=True, exist_ok=True)
    stage = cfg.bench.gpu.stage
    if stage == "list":
        fp = fingerprint(cfg, command_line_overrides())
        return {"stages": stages(cfg), "state": stage_states(out, stages(cfg), fp), "fingerprint": fp}
    if stage == "all":
        for name in stages(cfg):
            torch.compiler.reset()  # every stage compiles from scratch, as in its own process
            run_stage(cfg, name, out, command_line_overrides())
        stage = "merge"
    if stage == "merge":
        return merge(cfg, out)
    return run_stage(cfg, stage, out, command_line_overrides())


def merge(cfg: DictConfig, out: Path) -> dict:
    """Join the stage JSONs found in `out` into bench_gpu.json and bench_gpu.md (missing stages: listed). They
    must share one fingerprint (whichever machine merges: the stages' own, not this command's)."""
    found = {s: json.loads((out / f"{s}.json").read_text()) for s in stages(cfg) if (out / f"{s}.json").exists()}
    check_one_fingerprint(out, found)
    first = next(iter(found.values()), {})
    r = {"device": first.get("device", device_name()), "date": first.get("date", time.strftime("%Y-%m-%d")),
         "model": first.get("model", cfg.model.name), "torch": first.get("torch", torch.__version__),
         "fingerprint": first.get("fingerprint"), "missing": [s for s in stages(cfg) if s not in found],
         "stage_seconds": {s: v["seconds"] for s, v in found.items()},
         "train": {s.removeprefix("train_"): v["result"] for s, v in found.items() if s.startswith("train_")},
         "sampler": {s.removeprefix("sampler_"): v["result"] for s, v in found.items() if s.startswith("sampler_")},
         "flex_vs_dense": found.get("flex", {}).get("result"), "memory": found.get("memory", {}).get("result"),
         "play": joined_play(found.get("play", {}).get("result"), found.get("play_more", {}).get("result"))}
    if {"causal", "diagd"} <= r["train"].keys():
        r["diagd_over_causal_step"] = round(r["train"]["diagd"]["ms_per_step"] / r["train"]["causal"]["ms_per_step"], 3)
    r["targets"] = check_targets(r, cfg.bench.gpu.targets)
    write_json(out / "bench_gpu.json", r)
    write_atomic(out / "bench_gpu.md", markdown(r))
    return r


def check_one_fingerprint(out: Path, found: dict[str, dict]) -> None:
    """Refuse to merge stages measured by different runs (a tiny CPU run's with a GPU run's, two models...)."""
    groups: dict[str, list[str]] = {}
    for name, stage in found.items():
        groups.setdefault(json.dumps(stage.get("fingerprint"), sort_keys=True), []).append(f"{name}.json")
    if len(groups) > 1:
        described = "; ".join(f"{', '.join(files)}: {fp}" for fp, files in groups.items())
        raise ValueError(f"{out} holds stages measured by different runs, not merged: {described}. Delete or move "
                         f"the stage files of the run not wanted (scripts/gpu_check.sh moves a stage measured by "
                         f"another run to <stage>.json.stale and runs it again)")


def check_targets(r: dict, t: DictConfig) -> list[dict]:
    """The targets (bench.gpu.targets), each with its measured value (None where its stage is missing) and whether
    it is met."""
    rows = []

    def add(what, value, target, higher_is_better):
        met = None if value is None else (value >= target if higher_is_better else value <= target)
        rows.append({"target": what, "value": value, "goal": (">= " if higher_is_better else "<= ") + str(target),
                     "met": met})

    for mask, tr in r["train"].items():
        add(f"training MFU, {mask}", tr["mfu"], t.mfu, True)
    causal = {name: tr["mfu"] for name, tr in r["train"].items() if tr.get("mask") == "causal" and tr["mfu"]}
    fastest = max(causal, key=causal.get, default=None)
    add(f"causal training MFU, the fastest configuration ({fastest or 'none measured'})",
        causal.get(fastest), t.mfu_fastest_causal, True)
    add("DiagD step / causal step", r.get("diagd_over_causal_step"), t.diagd_over_causal, False)
    frames = max((int(k.split("_")[1].removesuffix("f")) for k in r["sampler"]), default=None)
    diag = r["sampler"].get(f"diagd_{frames}f")
    add(f"DiagD frames/s at {frames} frames", diag["fps"] if diag else None, t.diagd_fps, True)
    for name, s in r["sampler"].items():
        add(f"{name}: ms/pass over the bandwidth floor", s["over_floor"], t.pass_over_floor, False)
    for n, p in ((r.get("play") or {}).get("sessions") or {}).items():
        add(f"play, {n} session(s): frames/s over the bandwidth floor", p["of_floor"], t.play_of_floor, True)
        if n == "1":
            add("play, one player: p95 ms from an action to its frame", p["p95_ms"], t.play_p95_ms, False)
    return rows


def markdown(r: dict) -> str:
    na = "n/a"
    lines = [f"## GPU check: {r['model']} on {r['device']} ({r['date']}, torch {r['torch']})", ""]
    if r["missing"]:
        lines += [f"Missing stages (failed, timed out or not run): {', '.join(r['missing'])}", ""]
    lines += ["| mask | precision | compile | act. ckpt | batch x rows | ms/step | tokens/s | TFLOP/s | MFU | "
              "syncs/step | peak alloc. / reserved GiB |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | "
              "--- | --- |"]
    for name, t in r["train"].items():
        mfu_ = f"{100 * t['mfu']:.1f}%" if t["mfu"] is not None else na
        lines.append(f"| {name} | {t['precision']} | {t['compile']} | {t['activation_checkpointing']} | "
                     f"{t['batch_size']} x {t['seq_len']} | {t['ms_per_step']} | {t['tokens_per_s']:,.0f} | "
                     f"{t['tflops_per_s']} | {mfu_} | "
                     f"{t['host_syncs_per_step'] if t['host_syncs_per_step'] is not None else na} | "
                     f"{t['peak_allocated_gib'] or na} / {t['peak_reserved_gib'] or na} |")
    lines += ["", "| sampler | frames | passes | ms/pass | floor ms/pass | over floor | frames/s | rows/pass | "
              "cache cols/pass | compiled |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in r["sampler"].values():
        lines.append(f"| {s['sampler']} k={s['k']} | {s['clip_frames']} | {s['passes']} | {s['ms_per_pass']} | "
                     f"{s['floor_ms_per_pass'] or na} | {s['over_floor'] or na} | {s['fps']} | "
                     f"{s['padded_rows_per_pass']} | {s['cache_cols_per_pass']} | {s['compile']} |")
    play = r.get("play")
    if play:
        lines += ["", f"| play: sessions (context {play['context']}, k={play['k']}, d={play['d']}) | ms/tick | "
                      f"frames/s each | frames/s all | floor, all | of floor | p50 / p95 ms action to frame | "
                      f"KV splits (ms/tick unsplit) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for p in play["sessions"].values():
            unsplit = f" ({p['ms_per_tick_unsplit']})" if p.get("ms_per_tick_unsplit") else ""
            lines.append(f"| {p['sessions']} | {p['ms_per_tick']} | {p['fps_per_session']} | {p['fps_total']} | "
                         f"{p['floor_fps_total'] or na} | {p['of_floor'] or na} | {p['p50_ms']} / {p['p95_ms']} | "
                         f"{p.get('kv_splits', 1)}{unsplit} |")
    f = r["flex_vs_dense"]
    lines.append("")
    if f:
        lines.append(f"- flex vs dense ({f['dtype']}, {f['seq_len']} rows): max rel. error {f['max_rel_err']} "
                     f"(tolerance {f['tolerance']}), argmax agreement {f['argmax_agreement']}: "
                     f"{'ok' if f['ok'] else 'FAIL'}")
    for mask, m in (r["memory"] or {}).items():
        lines.append(f"- memory, {mask} ({m['seq_len']} rows): planned {m['planned_peak_gib']} GiB, measured "
                     f"{m['peak_allocated_gib'] or na} GiB allocated, {m['peak_reserved_gib'] or na} GiB reserved")
    lines += ["- stage seconds: " + ", ".join(f"{s} {v}" for s, v in r["stage_seconds"].items()), "",
              "| target | value | goal | met |", "| --- | --- | --- | --- |"]
    lines += [f"| {t['target']} | {t['value'] if t['value'] is not None else na} | {t['goal']} | "
              f"{na if t['met'] is None else ('yes' if t['met'] else 'NO')} |" for t in r["targets"]]
    return "\n".join(lines) + "\n"


