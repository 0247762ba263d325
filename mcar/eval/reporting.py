"""What evaluation writes: the results table (csv + md), per-frame curves, side-by-side videos, the W&B run, and
one table for a whole sweep."""
from __future__ import annotations

import csv
import io
import logging
import math
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from mcar.data.files import write_atomic, writing_into
from mcar.eval import metrics as M
from mcar.eval.idm import PR_COLUMNS
from mcar.hydra_app import hydra_job
from mcar.tokenizer.clips import split_clip
from mcar.tokenizer.pictures import action_labels, data_action_space, decode_frames, side_by_side, to_u8, write_gif
from mcar.tokenizer.video import write_mp4

log = logging.getLogger("mcar.eval.evaluate")
COLUMNS = ["model", "sampler", "fvd", "psnr", "ssim", "lpips", "unchanged", "action_f1", "action_acc",
           "action_f1_gt", *PR_COLUMNS, "loss_tf", "fps", "tp", "step", "clips", "frames", "prompt_frames", "notes"]
INT_COLUMNS = ("step", "clips", "frames", "prompt_frames")


# ------------------------------------------------------------------------------------------------ tables
def write_table(rows: list[dict], out: Path, stem: str = "results") -> None:
    """rows -> <stem>.csv and <stem>.md (the paper-style table; 'n/a' for unavailable metrics)."""
    out.mkdir(parents=True, exist_ok=True)
    table = io.StringIO(newline="")
    w = csv.DictWriter(table, COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows([{k: _csv_cell(r.get(k)) for k in COLUMNS} for r in rows])
    write_atomic(out / f"{stem}.csv", table.getvalue())  # a kill or a full disk leaves the last whole table
    head = md_columns()
    lines = ["| " + " | ".join(c.upper() if c in ("fvd", "psnr", "ssim", "lpips", "fps", "tp", "step") else c
                               for c in head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(md_cell(r, c) for c in head) + " |")
    where: dict[str, list[str]] = {}  # note -> the rows it applies to
    for r in rows:
        for n in filter(None, str(r.get("notes") or "").split("; ")):
            where.setdefault(n, []).append(str(r["sampler"]))
    if where:
        lines += ["", "notes:"] + [f"- {n}" + ("" if len(w) == len(rows) else f" ({', '.join(w)})")
                                   for n, w in where.items()]
    write_atomic(out / f"{stem}.md", "\n".join(lines) + "\n")


DIGITS = {"unchanged": 3, "ssim": 3, "lpips": 3, "action_f1": 3, "action_acc": 3, "action_f1_gt": 3, "loss_tf": 3,
          "tp": 0}


def md_columns() -> list[str]:
    """The results.md header: COLUMNS without notes, each prec_<a> / rec_<a> pair read as one '<a> P/R' column."""
    return [f"{c[5:]} P/R" if c.startswith("prec_") else c for c in COLUMNS
            if c != "notes" and not c.startswith("rec_")]


def md_cell(r: dict, c: str) -> str:
    if c.endswith(" P/R"):  # precision/recall of one action, e.g. 0.92/0.85
        a = c[:-4]
        return f"{M.fmt(r.get(f'prec_{a}'), 2)}/{M.fmt(r.get(f'rec_{a}'), 2)}"
    return M.fmt(r.get(c), DIGITS.get(c, 2))


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
    if not cfg.get("logger") or "wandb" not in str(cfg.logger.get("_target_", "")).lower():
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
        for c in ("fvd", "psnr", "unchanged", "ssim", "lpips", "action_f1", "loss_tf", "fps", "tp", "step"):
            if _finite(r.get(c)) is not None:
                run.summary[f"{r['sampler']}/{c}"] = r[c]


# ------------------------------------------------------------------------------------------------ media
def write_videos(cfg, gt, outputs, layout, cb, vq, out: Path) -> dict:
    """mp4 + gif of ground truth | each row's frames for the first `videos` clips -> {W&B key: path}."""
    if isinstance(vq, M.Unavailable) or cfg.videos <= 0:
        return {}
    media = {}
    space = data_action_space(cfg.data)
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

    merge_rows(Path(HydraConfig.get().sweep.dir), rows)


def merge_rows(sweep: Path, rows: list[dict]) -> None:
    """Add `rows` to <sweep>/results.{csv,md}: a read-modify-write under the folder's lock, so jobs that finish
    together (a parallel launcher) never drop each other's rows."""
    key = lambda r: (r["model"], r["sampler"])
    mine = {key(r) for r in rows}  # a re-run (or the reference rows every job adds) replaces, never duplicates
    with writing_into(sweep, "the sweep's results table", ".mcar-results.lock"):
        write_table([r for r in read_table(sweep / "results.csv") if key(r) not in mine] + rows, sweep)
