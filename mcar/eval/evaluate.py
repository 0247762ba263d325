"""Evaluate a world model as the paper does: held-out clips, P prompt frames + every action as the prompt,
generate the rest, compare with the ground truth. One results row per sampler setting.

    python -m mcar.evaluate ckpt=checkpoints/<run>/last.ckpt data=crafter sampler=diagd schedule.k=2
    python -m mcar.evaluate -m ckpt=... 'sampler=ntp,diagd' n_clips=16     # rows gather in <sweep dir>/results.*
    python -m mcar.evaluate ckpt=... fvd.i3d=/weights/i3d_torchscript.pt lpips=/weights/lpips_alex.pt idm=...

Columns: FVD (I3D from a local TorchScript file), PSNR / SSIM / LPIPS of generated vs ground-truth frames (both
decoded by the VQ, so the VQ's own loss is not counted), the action-following macro F1 of the inverse-dynamics
model (`python -m mcar.idm`) on generated frame pairs vs the conditioning actions (and on ground-truth pairs, its
ceiling), FPS (generated frames per second), TP (generated tokens per second), STEP (forward passes per clip,
i.e. per batch), LOSS_TF (the teacher-forced cross-entropy of the generated image tokens on the sampler's own
schedule, ground truth fed: for DiagD the loss the fine-tuning masks train). Speed is timed around generation
only, after a warm-up, synchronised on GPU; the model samples in bfloat16 on CUDA and float32 on CPU (dtype=auto).
A metric whose weights are missing is 'n/a' with the reason in `notes`. Everything logged to W&B is also written
to the run's output dir: results.{md,csv,json}, per_frame.csv, videos/, mask_<sampler>.png.
"""
from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from tqdm import tqdm

import mcar.config  # noqa: F401  (registers resolvers)
from mcar.eval import metrics as M
from mcar.config import to_dict
from mcar.eval.idm import action_names, action_scores, check_idm_fits, frame_pairs, load_idm
from mcar.core.layout import Layout
from mcar.train.task import check_state_shapes, finish_wandb, hydra_job, load_checkpoint
from mcar.core.sampler import build_sampler
from mcar.tokenizer.render import (action_labels, decode_frames, invalid_image_tokens, mask_image, schedule_table, side_by_side,
                      split_clip, to_u8, write_gif, write_mp4, write_png)

log = logging.getLogger("mcar.eval.evaluate")
COLUMNS = ["model", "sampler", "fvd", "psnr", "ssim", "lpips", "action_f1", "action_acc", "action_f1_gt", "loss_tf",
           "fps", "tp", "step", "clips", "frames", "prompt_frames", "notes"]
INT_COLUMNS = ("step", "clips", "frames", "prompt_frames")


# ------------------------------------------------------------------------------------------------ loading
def resolve_ckpt(ckpt: str | None) -> Path:
    """ckpt=<file.ckpt> or ckpt=<run dir holding last.ckpt> -> the file; clear errors otherwise."""
    if not ckpt:
        raise ValueError("ckpt is required: ckpt=checkpoints/<run_name>/last.ckpt (or the run's folder)")
    p = Path(ckpt)
    if p.is_dir():
        p = p / "last.ckpt"
    if not p.is_file():
        raise FileNotFoundError(f"ckpt: checkpoint not found: {p}")
    return p


SAMPLING_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def sampling_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """dtype=auto|float32|bfloat16 (None: auto) -> the weights' and KV cache's dtype for sampling on `device`.
    auto: bfloat16 on CUDA (half the bytes a memory-bound pass reads), float32 elsewhere (CPUs lack fast bf16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in SAMPLING_DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid; choose auto, {', '.join(SAMPLING_DTYPES)}")
    return SAMPLING_DTYPES[dtype]


def load_model(ckpt: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None):
    """A Lightning checkpoint of train.py / finetune.py -> (MCARModule in eval mode, its hyper-parameters).

    Parameters are cast to `dtype` (see `sampling_dtype`; default bfloat16 on CUDA, float32 on CPU), buffers are
    not: RoPE's frequencies stay float32, as in mixed-precision training. The samplers' KV cache follows the
    weights' dtype."""
    from mcar.train.module import MCARModule

    path = resolve_ckpt(None if ckpt is None else str(ckpt))
    state = load_checkpoint(path)
    hp = dict(state.get("hyper_parameters") or {})
    if "arch" not in hp or "layout" not in hp:
        raise ValueError(f"{path} has no mcar hyper_parameters (arch, layout): not a train.py checkpoint")
    hp["compile"] = False
    module = MCARModule(**hp)
    check_state_shapes(module, state["state_dict"], str(path))
    module.load_state_dict(state["state_dict"])
    module = module.to(device).eval()
    dtype = sampling_dtype(dtype, device)
    with torch.no_grad():
        for p in module.parameters():
            p.data = p.data.to(dtype)
    return module, hp


def check_data_fits(layout: Layout, hp: dict, data: DictConfig) -> None:
    own = Layout(**hp["layout"])
    if (own.h, own.w, own.n_a) != (data.h, data.w, data.n_a) or hp["arch"]["vocab_size"] < data.vocab_size:
        raise ValueError(f"data={data.name} (h, w, n_a, vocab) = ({data.h}, {data.w}, {data.n_a}, {data.vocab_size}) "
                         f"does not fit the checkpoint's ({own.h}, {own.w}, {own.n_a}, {hp['arch']['vocab_size']}): "
                         f"pass the data config the model was trained on (data=..., data.h=...)")


def held_out_data(cfg: DictConfig, frames: int):
    """The data module of the configured data, set up with `frames`-frame clips (val_source: held-out clips)."""
    with open_dict(cfg):
        cfg.data.clip_frames = frames
    dm = hydra.utils.instantiate(cfg.data, _recursive_=False)
    dm.prepare_data()
    dm.setup("validate")
    return dm


def held_out_source(cfg: DictConfig, frames: int):
    """The validation clips (held-out episodes) of the configured data, `frames` frames long."""
    return held_out_data(cfg, frames).val_source


def pick_clips(source, n_clips: int, ids=None) -> list[int]:
    """Explicit `clips` ids, else n_clips evenly spaced over the held-out set (little overlap between clips)."""
    n = len(source)
    if ids:
        bad = [i for i in ids if not 0 <= int(i) < n]
        if bad:
            raise ValueError(f"clips={list(ids)}: ids {bad} out of range; the held-out set has {n} clips (0..{n - 1})")
        return [int(i) for i in ids]
    if n == 0:
        raise ValueError("the held-out set has no clip of that length (lower frames=, or use more val episodes)")
    k = min(n_clips, n)
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})


def load_vq_for(cfg: DictConfig, device: torch.device | str = "cpu"):
    """The VQ that decodes the data's tokens (vq.path; the committed small VQ when the data names none)."""
    from mcar.tokenizer.vq import load_vq

    return load_vq(OmegaConf.select(cfg, "vq.path", default=None)).to(device)


# ------------------------------------------------------------------------------------------------ generation
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate_clips(model, sampler, clips: torch.Tensor, batch_size: int, warmup: bool = True):
    """clips (n, N) -> generated (n, N) and speed {fps, tp, step, seconds}; timing excludes the warm-up."""
    if warmup:
        sampler.generate(model, clips[:batch_size])
    out, seconds, tokens, passes = [], 0.0, 0, 0
    for batch in tqdm(clips.split(batch_size), desc=f"generate {sampler.name}", mininterval=5):
        sync(batch.device)
        tokens_b, stats = sampler.generate(model, batch)  # times itself, synchronised on GPU
        out.append(tokens_b)
        seconds, tokens, passes = seconds + stats.seconds, tokens + stats.tokens, max(passes, stats.passes)
    model.clear_cache()
    sched = sampler.schedule()
    frames = len(clips) * (sched.frames - sched.prompt_frames)
    return torch.cat(out), {"fps": frames / seconds, "tp": tokens / seconds, "step": passes, "seconds": seconds}


@torch.no_grad()
def teacher_forced_loss(model, sampler, clips: torch.Tensor, batch_size: int) -> float:
    """Mean cross-entropy of every generated image token, the clips' own tokens fed on the sampler's schedule."""
    nll = torch.cat([sampler.teacher_forced(model, b, keep_logits=False).nll for b in clips.split(batch_size)])
    model.clear_cache()
    return float(nll.double().mean())


def reference_clips(kind: str, clips: torch.Tensor, gen_slots: torch.Tensor, codebook_size: int, seed: int = 0):
    """Reference rows: 'ground_truth' (the clips themselves: PSNR inf) or 'noise' (random generated tokens)."""
    if kind == "ground_truth":
        return clips.clone()
    if kind == "noise":
        out = clips.clone()
        g = torch.Generator().manual_seed(seed)
        out[:, gen_slots] = torch.randint(0, codebook_size, (len(clips), len(gen_slots)), generator=g).to(out)
        return out
    raise ValueError(f"references: unknown {kind!r}; choose from ground_truth, noise")


# ------------------------------------------------------------------------------------------------ scoring
def score(gen: torch.Tensor, gt: torch.Tensor, layout: Layout, codebook_size: int, P: int, vq, nets: dict,
          names: dict) -> tuple[dict, dict, dict]:
    """-> (row metrics, per-frame curves {psnr, ssim, lpips: [T-P]}, extra {per_action}) for generated vs gt."""
    row, curves, extra = {}, {}, {}
    if isinstance(vq, M.Unavailable):
        pix_gen = pix_gt = vq
    else:
        try:
            pix_gen = decode_frames(vq, split_clip(gen.cpu(), layout, codebook_size)[0])  # (n, T, 3, H, W)
            pix_gt = decode_frames(vq, split_clip(gt.cpu(), layout, codebook_size)[0])
        except ValueError as e:
            pix_gen = pix_gt = M.Unavailable(str(e))
    if isinstance(pix_gen, M.Unavailable):
        for k in ("psnr", "ssim", "lpips", "fvd"):
            row[k] = pix_gen
    else:
        g, t = pix_gen[:, P:], pix_gt[:, P:]  # generated frames only
        psnr, ssim = M.psnr_per_frame(g, t), M.ssim_per_frame(g, t)
        curves["psnr"], curves["ssim"] = M.mean_over_clips(psnr), M.mean_over_clips(ssim)
        row["psnr"], row["ssim"] = float(psnr.double().mean()), float(ssim.double().mean())
        lp = M.lpips_per_frame(nets["lpips"], g, t)
        row["lpips"] = lp if isinstance(lp, M.Unavailable) else float(lp.mean())
        if not isinstance(lp, M.Unavailable):
            curves["lpips"] = M.mean_over_clips(lp)
        row["fvd"] = M.fvd(nets["i3d"], pix_gen, pix_gt)  # whole clips, as MineWorld
    idm = nets["idm"]
    if isinstance(idm, M.Unavailable):
        row["action_f1"] = row["action_acc"] = row["action_f1_gt"] = idm
    else:
        a, b, act = frame_pairs(gen.cpu(), layout, codebook_size, first=P - 1)  # pairs ending in a generated frame
        s = action_scores(idm.predict(a, b), act, names)
        a, b, _ = frame_pairs(gt.cpu(), layout, codebook_size, first=P - 1)
        s_gt = action_scores(idm.predict(a, b), act, names)
        row.update(action_f1=s["macro_f1"], action_acc=s["accuracy"], action_f1_gt=s_gt["macro_f1"])
        extra["per_action"], extra["per_action_gt"] = s["per_action"], s_gt["per_action"]
    by_reason: dict[str, list[str]] = {}
    for k, v in row.items():
        if isinstance(v, M.Unavailable):
            by_reason.setdefault(v.reason, []).append(k)
    row["notes"] = "; ".join(f"{', '.join(keys)}: {reason}" for reason, keys in by_reason.items())
    return row, curves, extra


def score_rows(outputs: dict, gt, layout, cb, P, vq, nets, names, common: dict):
    """{label: (clips, speed)} -> table rows, per-frame curves and per-action extras, one per label."""
    rows, curves, extras = [], {}, {}
    for label, (clips, spd) in outputs.items():
        clips, n_bad = invalid_image_tokens(clips, layout, cb)
        outputs[label] = (clips, spd)  # videos show what was scored
        row, curves[label], extras[label] = score(clips, gt, layout, cb, P, vq, nets, names)
        if n_bad:
            n_img = len(clips) * (gt.shape[1] // layout.frame_len - P) * layout.frame_tokens
            row["notes"] = "; ".join(filter(None, [f"{n_bad}/{n_img} generated image tokens were action ids "
                                                   f"(scored as code 0)", row["notes"]]))
        rows.append({**common, "sampler": label, **row, **{k: spd.get(k) for k in ("loss_tf", "fps", "tp", "step")}})
    return rows, curves, extras


def sampler_label(sampler) -> str:
    """'ntp', or 'diagd k=2[ d=28][ proxy=above][ full]': the sampler and its schedule."""
    if sampler.name != "diagd":
        return sampler.name
    c = sampler.config
    return (f"diagd k={c.k}" + (f" d={c.d}" if c.d is not None else "")
            + (f" proxy={c.proxy}" if c.proxy != "prev_frame" else "") + (" full" if c.full else ""))


# ------------------------------------------------------------------------------------------------ tables
def write_table(rows: list[dict], out: Path, stem: str = "results") -> None:
    """rows -> <stem>.csv and <stem>.md (the paper-style table; 'n/a' for unavailable metrics)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows([{k: _csv_cell(r.get(k)) for k in COLUMNS} for r in rows])
    head = [c for c in COLUMNS if c != "notes"]
    lines = ["| " + " | ".join(c.upper() if c in ("fvd", "psnr", "ssim", "lpips", "fps", "tp", "step") else c
                               for c in head) + " |", "|" + " --- |" * len(head)]
    digits = {"ssim": 3, "lpips": 3, "action_f1": 3, "action_acc": 3, "action_f1_gt": 3, "loss_tf": 3, "tp": 0}
    for r in rows:
        lines.append("| " + " | ".join(M.fmt(r.get(c), digits.get(c, 2)) for c in head) + " |")
    where: dict[str, list[str]] = {}  # note -> the rows it applies to
    for r in rows:
        for n in filter(None, str(r.get("notes") or "").split("; ")):
            where.setdefault(n, []).append(str(r["sampler"]))
    if where:
        lines += ["", "notes:"] + [f"- {n}" + ("" if len(w) == len(rows) else f" ({', '.join(w)})")
                                   for n, w in where.items()]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


def _csv_cell(v):
    if v is None or isinstance(v, M.Unavailable):
        return ""
    return v


def read_table(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = list(csv.DictReader(open(path)))
    for r in rows:
        for k, v in r.items():
            if k not in ("model", "sampler", "notes"):
                r[k] = None if v in ("", None) else int(float(v)) if k in INT_COLUMNS else float(v)
    return rows


def write_per_frame(curves: dict[str, dict], P: int, out: Path) -> list[list]:
    """{row label: {metric: [T-P values]}} -> per_frame.csv rows [label, frame, psnr, ssim, lpips]."""
    table = []
    for label, c in curves.items():
        for i, v in enumerate(c.get("psnr", [])):
            table.append([label, P + i, v, c["ssim"][i], c["lpips"][i] if "lpips" in c else None])
    with open(out / "per_frame.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["row", "frame", "psnr", "ssim", "lpips"])
        w.writerows(table)
    return table


# ------------------------------------------------------------------------------------------------ W&B
def _finite(v):
    return None if v is None or isinstance(v, M.Unavailable) or (isinstance(v, float) and not math.isfinite(v)) else v


def log_wandb(cfg: DictConfig, rows: list[dict], per_frame: list[list], media: dict) -> None:
    """Results table, per-frame PSNR curves, videos and the mask image to the configured W&B run."""
    if not cfg.get("logger") or "Wandb" not in str(cfg.logger.get("_target_", "")):
        return
    import wandb

    run = hydra.utils.instantiate(cfg.logger).experiment
    run.config.update(OmegaConf.to_container(cfg, resolve=True), allow_val_change=True)
    run.log({"eval/results": wandb.Table(columns=COLUMNS, data=[[_finite(r.get(c)) if c not in ("model", "sampler",
                                                                                               "notes") else r.get(c)
                                                               for c in COLUMNS] for r in rows])})
    frames_table = wandb.Table(columns=["row", "frame", "psnr", "ssim", "lpips"],
                               data=[[_finite(x) for x in r] for r in per_frame])
    run.log({"eval/per_frame": frames_table,
             "eval/psnr_per_frame": wandb.plot.line(frames_table, "frame", "psnr", stroke="row",
                                                    title="PSNR per frame index")})
    for key, path in media.items():
        if path.suffix == ".png":
            run.log({key: wandb.Image(str(path))})
        else:
            run.log({key: wandb.Video(str(path), format=path.suffix[1:])})
    for r in rows:
        for c in ("fvd", "psnr", "ssim", "lpips", "action_f1", "loss_tf", "fps", "tp", "step"):
            if _finite(r.get(c)) is not None:
                run.summary[f"{r['sampler']}/{c}"] = r[c]


# ------------------------------------------------------------------------------------------------ the job
def evaluate(cfg: DictConfig) -> list[dict]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    module, hp = load_model(cfg.ckpt, device, sampling_dtype(cfg.get("dtype"), device))
    layout, cb = module.layout, cfg.data.codebook_size
    check_data_fits(layout, hp, cfg.data)
    frames = cfg.frames or hp["clip_frames"]
    scfg = to_dict(cfg.sampler)
    sampler = build_sampler(scfg, layout, frames, cb, schedule=to_dict(cfg.schedule))
    P = sampler.prompt_frames
    dm = held_out_data(cfg, frames)
    source = dm.val_source
    ids = pick_clips(source, cfg.n_clips, cfg.clips)
    gt = torch.stack([source.clip(i) for i in ids]).to(device)  # (n, N)
    log.info("%s: %d held-out clips of %d frames, %d prompt frame(s), sampler %s", cfg.ckpt, len(ids), frames, P,
             sampler_label(sampler))

    nets = {"i3d": M.load_torchscript(cfg.fvd.i3d, "I3D", "fvd.i3d"),
            "lpips": M.load_torchscript(cfg.lpips, "LPIPS", "lpips"),
            "idm": check_idm_fits(load_idm(cfg.idm), dm, cb, layout.n_a, cfg.data.action_vocab_size)}
    try:
        vq = load_vq_for(cfg, device)
    except FileNotFoundError as e:
        vq = M.Unavailable(str(e))
    names = action_names(cfg.data.name, cfg.data.action_vocab_size)
    model_name = cfg.name or resolve_ckpt(cfg.ckpt).parent.name

    gen, speed = generate_clips(module.model, sampler, gt, cfg.batch_size, cfg.warmup)
    speed["loss_tf"] = teacher_forced_loss(module.model, sampler, gt, cfg.batch_size)
    outputs = {sampler_label(sampler): (gen, speed)}
    for kind in cfg.references:
        outputs[kind] = (reference_clips(kind, gt, sampler.schedule().gen_slots.to(device), cb, cfg.seed), {})

    common = {"model": model_name, "clips": len(ids), "frames": frames, "prompt_frames": P}
    rows, curves, extras = score_rows(outputs, gt, layout, cb, P, vq, nets, names, common)
    media = write_videos(cfg, gt, outputs, layout, cb, vq, out)
    mask = write_png(mask_image(schedule_table(sampler)), out / f"mask_{sampler.name}.png")
    media[f"eval/mask_{sampler.name}"] = mask

    write_table(rows, out)
    per_frame = write_per_frame(curves, P, out)
    (out / "results.json").write_text(json.dumps(
        {"rows": [{k: (str(v) if isinstance(v, M.Unavailable) else v) for k, v in r.items()} for r in rows],
         "per_frame": curves, "clip_ids": ids, "speed": {k: v[1] for k, v in outputs.items()}, "extra": extras},
        indent=2, default=str))
    gather_sweep(rows)
    log_wandb(cfg, rows, per_frame, media)
    log.info("results (%s):\n%s", out, (out / "results.md").read_text())
    return rows


def write_videos(cfg, gt, outputs, layout, cb, vq, out: Path) -> dict:
    """mp4 + gif of ground truth | each row's frames for the first `videos` clips -> {W&B key: path}."""
    if isinstance(vq, M.Unavailable) or cfg.videos <= 0:
        return {}
    media = {}
    space = cfg.data.name if cfg.data.name in ("crafter", "vpt") else None
    for i in range(min(cfg.videos, len(gt))):
        ids, acts = split_clip(gt[i:i + 1].cpu(), layout, cb)
        try:
            cols = {"ground truth": to_u8(decode_frames(vq, ids)[0])}
            for label, (clips, _) in outputs.items():
                if label == "ground_truth":
                    continue
                cols[label] = to_u8(decode_frames(vq, split_clip(clips[i:i + 1].cpu(), layout, cb)[0])[0])
        except ValueError as e:
            log.warning("no videos: %s", e)
            return {}
        video = side_by_side(cols, action_labels(acts[0], space))
        write_mp4(video, out / "videos" / f"clip{i}.mp4", cfg.fps)
        media[f"eval/video_clip{i}"] = write_gif(video, out / "videos" / f"clip{i}.gif", cfg.fps)
    return media


def gather_sweep(rows: list[dict]) -> None:
    """In a multirun, append this job's rows to <sweep dir>/results.{csv,md} (one table for the whole sweep)."""
    multi, _, _ = hydra_job()
    if not multi:
        return
    from hydra.core.hydra_config import HydraConfig

    sweep = Path(HydraConfig.get().sweep.dir)
    key = lambda r: (r["model"], r["sampler"])
    mine = {key(r) for r in rows}  # a re-run (or the reference rows every job adds) replaces, never duplicates
    write_table([r for r in read_table(sweep / "results.csv") if key(r) not in mine] + rows, sweep)


@hydra.main(version_base="1.3", config_path="../../conf", config_name="evaluate")
@finish_wandb
def main(cfg: DictConfig) -> None:
    evaluate(cfg)


if __name__ == "__main__":
    main()
