"""`python -m mcar.bench memory|gpu`: the planned training memory, and the one check a GPU machine runs first.

memory: the peak memory per device that the configured training step will need (mcar.train.memory), the largest batch
that fits bench.memory.budget_gib with and without activation checkpointing, and a whole-model measurement on
fake tensors as a cross-check.

gpu: `python -m mcar.bench gpu experiment=paper model=700m data=synthetic logger=csv` trains through train.py's own
path (Lightning, the configured trainer, precision, activation checkpointing, per-block compile on CUDA) for a few
steps per mask (step time, tokens/s, MFU, peak memory against the plan), checks that flex attention with the DiagD
BlockMask equals SDPA with the dense mask in the training dtype, and runs the sampler speed check. One JSON file
and one markdown table in the run dir. The same command runs on CPU at tiny sizes (tests/test_gpucheck.py). With
data=synthetic and logger=csv it imports none of wandb, av, diffusers, crafter.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from mcar.config import to_dict
from mcar.core.flops import peak_flops, train_flops_per_token
from mcar.core.layout import Layout
from mcar.core.masks import build_mask_factory
from mcar.train.memory import GiB, measure_step_peak, plan_training
from mcar.core.model import ModelConfig, Transformer
from mcar.tokenizer.devices import resolve_device, sync


def training_shape(cfg: DictConfig) -> dict:
    """What the memory plan needs from a training config: sequence rows (the mask's input sequence), batch,
    precision, activation checkpointing, FSDP devices."""
    layout = Layout(int(cfg.data.h), int(cfg.data.w), int(cfg.data.n_a))
    mcfg = to_dict(cfg.mask)
    factory = build_mask_factory(mcfg.pop("name"), layout, int(cfg.data.clip_frames), schedule=to_dict(cfg.schedule),
                                 **mcfg | {"backend": "sdpa"})
    seq_len = int(factory(torch.zeros(1, layout.n_slots(int(cfg.data.clip_frames)), dtype=torch.long)).tokens.shape[1])
    strategy = OmegaConf.select(cfg, "trainer.strategy", default="auto")
    fsdp = isinstance(strategy, DictConfig) and "ModelParallel" in str(strategy.get("_target_", ""))
    return dict(seq_len=seq_len, batch=int(cfg.data.batch_size), bf16=str(cfg.trainer.precision).startswith("bf16"),
                activation_checkpointing=bool(cfg.model.get("activation_checkpointing", False)),
                fsdp_devices=int(cfg.trainer.devices) * int(cfg.trainer.num_nodes) if fsdp else 1)


def run_memory(cfg: DictConfig) -> dict:
    shape = training_shape(cfg)
    m = cfg.bench.memory
    t0 = time.perf_counter()
    out = {"model": cfg.model.name, "clip_frames": int(cfg.data.clip_frames), "mask": cfg.mask.name} | \
        plan_training(to_dict(cfg.model.arch), shape["seq_len"], shape["batch"], bf16=shape["bf16"],
                      activation_checkpointing=shape["activation_checkpointing"],
                      fsdp_devices=shape["fsdp_devices"], budget_gib=m.budget_gib)
    if m.direct and shape["fsdp_devices"] == 1:
        peak = measure_step_peak(ModelConfig(**to_dict(cfg.model.arch)), shape["batch"], shape["seq_len"],
                                 torch.bfloat16 if shape["bf16"] else None, shape["activation_checkpointing"])
        out["direct_fake_peak_gib"] = round(peak / GiB, 3)
    return out | {"plan_seconds": round(time.perf_counter() - t0, 1)}


# ---- gpu ----------------------------------------------------------------------------------------------------
class StepTimes(Callback):
    """Wall time of every training step after the warm-up ones (device synchronised), and the FLOPs per token."""

    def __init__(self, warmup: int):
        self.warmup, self.times, self._t = warmup, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        sync(pl_module.device)
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sync(pl_module.device)
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._t)
        if hasattr(self, "flops_per_token"):  # the same every step
            return
        self.tokens = batch["tokens"].numel() * trainer.world_size
        self.flops_per_token = train_flops_per_token(
            pl_module.num_params(embeddings=False), pl_module.model_config.n_layers, pl_module.model_config.dim,
            pl_module.mask_factory(batch["tokens"][:1]).tokens.shape[1], pl_module.mask_density)


def train_overrides(cfg: DictConfig, mask: str, out: Path) -> list[str]:
    """The bench command's own overrides (experiment, model, data, trainer...) plus what a timing run needs."""
    g = cfg.bench.gpu
    user = [o for o in HydraConfig.get().overrides.task if not o.split("=")[0].lstrip("+~").startswith("bench.")]
    if not any(o.startswith("data=") for o in user):
        user = [f"data={cfg.data.name}"] + user  # the bench's default data (synthetic), not train.py's
    on_cuda = torch.cuda.is_available() and OmegaConf.select(cfg, "trainer.accelerator") != "cpu"
    compile_ = on_cuda if g.compile == "auto" else bool(g.compile)
    return user + [f"mask={mask}", "logger=csv", f"trainer.max_steps={int(g.steps)}", "trainer.limit_val_batches=0",
                   "val_dashboard.n_clips=0", "checkpoint.every_n_steps=null", "log_every_n_steps=1",
                   f"compile={compile_}", f"run_name=gpucheck-{mask}", f"paths.checkpoint_root={out}/ckpt"]


def train_check(cfg: DictConfig, mask: str, out: Path) -> dict:
    from mcar.train.task import run

    tcfg = compose(config_name="train", overrides=train_overrides(cfg, mask, out))
    with open_dict(tcfg):
        tcfg.paths.output_dir = str(out / f"train_{mask}")
    timer = StepTimes(int(cfg.bench.gpu.warmup_steps))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    metrics = run(tcfg, callbacks=[timer])
    wall = time.perf_counter() - t0
    if not timer.times:
        raise RuntimeError(f"bench.gpu.steps={cfg.bench.gpu.steps} leaves no timed step after "
                           f"bench.gpu.warmup_steps={cfg.bench.gpu.warmup_steps}")
    step = statistics.median(timer.times)
    dev = torch.device("cuda" if cuda and tcfg.trainer.accelerator != "cpu" else "cpu")
    peak = peak_flops(dev, tcfg.get("peak_flops"))
    world = int(tcfg.trainer.devices) * int(tcfg.trainer.num_nodes) if dev.type == "cuda" else 1
    shape = training_shape(tcfg)
    return {"mask": mask, "precision": str(tcfg.trainer.precision), "compile": bool(tcfg.compile),
            "activation_checkpointing": shape["activation_checkpointing"], "batch_size": shape["batch"],
            "seq_len": shape["seq_len"], "timed_steps": len(timer.times), "ms_per_step": round(1000 * step, 1),
            "tokens_per_s": round(timer.tokens / step, 1),
            "mfu": round(timer.flops_per_token * timer.tokens / step / (peak * world), 4) if peak else None,
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / GiB, 3) if dev.type == "cuda" else None,
            "final_loss": round(metrics.get("train/loss", float("nan")), 4), "wall_seconds": round(wall, 1)}


def flex_check(cfg: DictConfig) -> dict:
    """DiagD mask of the configured clip: flex + BlockMask against SDPA + dense mask, in the training dtype."""
    dev = resolve_device("auto")
    bf16 = str(cfg.trainer.precision).startswith("bf16") and dev.type == "cuda"
    dtype = torch.bfloat16 if bf16 else torch.float32
    arch = to_dict(cfg.model.arch) | {"n_layers": int(cfg.bench.gpu.flex_layers)}
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**arch)).to(dev, dtype).eval()
    layout, frames = Layout(int(cfg.data.h), int(cfg.data.w), int(cfg.data.n_a)), int(cfg.data.clip_frames)
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
            "tolerance": tol, "ok": err <= tol}


def sampler_check(cfg: DictConfig) -> dict:
    from mcar.bench import run_sampler

    scfg = cfg.copy()
    with open_dict(scfg):
        scfg.data.clip_frames = int(cfg.bench.gpu.sampler_frames)
        scfg.bench.compare = True
        scfg.sampler.name = "diagd"
    r = run_sampler(scfg)
    keep = ("k", "passes", "fps", "ms_per_pass", "speedup", "pass_ratio", "clip_frames", "dtype", "static", "compile")
    return {k: r.get(k) for k in keep} | {"ntp_fps": r["ntp"]["fps"], "ntp_ms_per_pass": r["ntp"]["ms_per_pass"]}


def run_gpu(cfg: DictConfig) -> dict:
    out = Path(cfg.bench.out).parent
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"device": device, "date": time.strftime("%Y-%m-%d"), "model": cfg.model.name,
              "torch": torch.__version__, "train": {}}
    t0 = time.perf_counter()
    for mask in cfg.bench.gpu.masks:
        result["train"][mask] = train_check(cfg, mask, out)
    if {"causal", "diagd"} <= result["train"].keys():
        result["diagd_over_causal_step"] = round(result["train"]["diagd"]["ms_per_step"] /
                                                 result["train"]["causal"]["ms_per_step"], 3)
    first = result["train"][cfg.bench.gpu.masks[0]]
    shape = training_shape(cfg)
    plan = plan_training(to_dict(cfg.model.arch), first["seq_len"], first["batch_size"], bf16=shape["bf16"],
                         activation_checkpointing=first["activation_checkpointing"], budget_gib=None,
                         device=resolve_device("auto").type)
    result["memory"] = {"planned_peak_gib": plan["peak_gib"], "measured_peak_gib": first["peak_memory_gib"]}
    result["flex_vs_dense"] = flex_check(cfg)
    result["sampler"] = sampler_check(cfg)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "bench_gpu.md").write_text(markdown(result))
    return result


def markdown(r: dict) -> str:
    lines = [f"## GPU check: {r['model']} on {r['device']} ({r['date']}, torch {r['torch']})", "",
             "| mask | precision | compile | act. ckpt | batch x rows | ms/step | tokens/s | MFU | peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in r["train"].values():
        mfu = f"{100 * t['mfu']:.1f}%" if t["mfu"] is not None else "n/a"
        lines.append(f"| {t['mask']} | {t['precision']} | {t['compile']} | {t['activation_checkpointing']} | "
                     f"{t['batch_size']} x {t['seq_len']} | {t['ms_per_step']} | {t['tokens_per_s']:,.0f} | {mfu} | "
                     f"{t['peak_memory_gib'] if t['peak_memory_gib'] is not None else 'n/a'} |")
    f, s, m = r["flex_vs_dense"], r["sampler"], r["memory"]
    lines += ["", f"- DiagD step / causal step: {r.get('diagd_over_causal_step', 'n/a')}",
              f"- memory: planned {m['planned_peak_gib']} GiB, measured {m['measured_peak_gib']} GiB (peak allocated)",
              f"- flex vs dense ({f['dtype']}, {f['seq_len']} rows): max rel. error {f['max_rel_err']} "
              f"(tolerance {f['tolerance']}), argmax agreement {f['argmax_agreement']}: {'ok' if f['ok'] else 'FAIL'}",
              f"- sampler ({s['clip_frames']} frames): DiagD k={s['k']} {s['fps']} frames/s ({s['ms_per_pass']} ms/pass), "
              f"NTP {s['ntp_fps']} frames/s ({s['ntp_ms_per_pass']} ms/pass), speedup {s['speedup']} for a pass "
              f"ratio of {s['pass_ratio']}", f"- total {r['seconds']} s", ""]
    return "\n".join(lines)


def write_json(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=1) + "\n")
