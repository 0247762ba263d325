"""What evaluation writes: the results table (csv + md + json; its columns: metric_registry), the narrow table the
terminal shows, per-frame curves, side-by-side videos, the W&B run, and one table for a whole sweep."""
from __future__ import annotations

import csv
import io
import json
import logging
import math
from pathlib import Path

from omegaconf import DictConfig

from mcar.atomic import write_atomic, written_atomically
from mcar.data.files import writing_into
from mcar.eval import metric_registry as R
from mcar.eval import networks as N
from mcar.hydra_app import hydra_job
from mcar.tokenizer.pictures import comparison_frames, data_action_space, write_video
from mcar.wandb_run import log_media, log_table, open_run

log = logging.getLogger("mcar.eval.evaluate")


# ------------------------------------------------------------------------------------------------ tables
def write_table(rows: list[dict], out: Path, stem: str = "results") -> None:
    """rows -> <stem>.csv (every column, each interval's bounds beside it) and <stem>.md (the paper-style table,
    'n/a' for unavailable metrics, [low, high] after a value with a bootstrap interval)."""
    out.mkdir(parents=True, exist_ok=True)
    keys = R.csv_keys(rows)
    table = io.StringIO(newline="")
    w = csv.DictWriter(table, keys, extrasaction="ignore")
    w.writeheader()
    w.writerows([{k: _csv_cell(r.get(k)) for k in keys} for r in rows])
    write_atomic(out / f"{stem}.csv", table.getvalue())  # a kill or a full disk leaves the last whole table
    head = md_columns(rows)
    lines = ["| " + " | ".join(c if c.endswith(" P/R") else R.column(c).header for c in head) + " |",
             "|" + " --- |" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(md_cell(r, c) for c in head) + " |")
    where: dict[str, list[str]] = {}  # note -> the rows it applies to
    for r in rows:
        for n in filter(None, str(r.get("notes") or "").split("; ")):
            where.setdefault(n, []).append(str(r["sampler"]))
    lines += ["", R.ci_note() + "."]
    if where:
        lines += ["", "notes:"] + [f"- {n}" + ("" if len(w) == len(rows) else f" ({', '.join(w)})")
                                   for n, w in where.items()]
    write_atomic(out / f"{stem}.md", "\n".join(lines) + "\n")


def md_columns(rows: list[dict]) -> list[str]:
    """The results.md header: the columns without notes, each prec_<a> / rec_<a> pair read as one '<a> P/R'."""
    return [f"{c.key[5:]} P/R" if c.key.startswith("prec_") else c.key for c in R.columns(rows)
            if c.key != "notes" and not c.key.startswith("rec_")]


def md_cell(r: dict, c: str) -> str:
    if c.endswith(" P/R"):  # precision/recall of one action, e.g. 0.92/0.85
        a = c[:-4]
        return f"{R.cell(r, f'prec_{a}')}/{R.cell(r, f'rec_{a}')}"
    return R.cell(r, c)


def terminal_table(rows: list[dict]) -> str:
    """The narrow table the terminal shows (the registry's `terminal` columns, values padded into aligned
    columns) and a one-line glossary; the full table is in results.md."""
    keys = [c.key for c in R.COLUMNS if c.terminal]
    grid = [[R.column(k).header for k in keys]] + [[R.cell(r, k) for k in keys] for r in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(keys))]
    lines = ["  ".join(x.ljust(n) for x, n in zip(line, widths)).rstrip() for line in grid]
    lines.insert(1, "  ".join("-" * n for n in widths))
    return "\n".join(lines + [R.glossary(k for k in keys if k != "sampler") + ". " + R.ci_note() + "."])


def _csv_cell(v):
    if v is None or isinstance(v, N.Unavailable):
        return ""
    return v


def read_table(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = list(csv.DictReader(open(path)))
    for r in rows:
        for k, v in r.items():
            kind = R.kind_of(k)
            if kind != "text":
                r[k] = None if v in ("", None) else int(float(v)) if kind == "int" else float(v)
    return rows


def write_results_json(out: Path, rows: list[dict], curves: dict, clip_ids: list[int], speed: dict,
                       extras: dict) -> None:
    """results.json: every row with the registry's keys in order (an unavailable metric as its reason), the
    per-frame curves, the clips scored, each row's speed, the per-action extras and how the intervals were made."""
    keys = R.csv_keys(rows)
    ordered = [{**{k: r.get(k) for k in keys if k in r}, **{k: v for k, v in r.items() if k not in keys}}
               for r in rows]
    write_atomic(out / "results.json", json.dumps(
        {"rows": [{k: (str(v) if isinstance(v, N.Unavailable) else v) for k, v in r.items()} for r in ordered],
         "per_frame": curves, "clip_ids": clip_ids, "speed": speed, "extra": extras,
         "intervals": {"method": "percentile bootstrap over clips", "level": R.CI_LEVEL,
                       "resamples": R.CI_RESAMPLES}},
        indent=2, default=str))


def per_frame_header() -> list[str]:
    return ["row", "frame", *(c.key for c in R.COLUMNS if c.per_frame)]


def write_per_frame(curves: dict[str, dict], P: int, out: Path) -> list[list]:
    """{row label: {metric: [T-P values]}} -> per_frame.csv rows [label, frame, <each per-frame column>]."""
    keys = per_frame_header()[2:]
    table = []
    for label, c in curves.items():
        for i in range(max((len(v) for v in c.values()), default=0)):
            table.append([label, P + i, *(c[k][i] if k in c else None for k in keys)])
    with written_atomically(out / "per_frame.csv") as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(per_frame_header())
        w.writerows(table)
    return table


# ------------------------------------------------------------------------------------------------ W&B
def _finite(v):
    return None if v is None or isinstance(v, N.Unavailable) or (isinstance(v, float) and not math.isfinite(v)) else v


def log_wandb(cfg: DictConfig, rows: list[dict], per_frame: list[list], media: dict) -> None:
    """Results table, per-frame PSNR curves, videos and the mask image to the configured W&B run."""
    run = open_run(cfg)
    if run is None:
        return
    keys = R.csv_keys(rows)
    log_table(run, "eval/results", keys, [[r.get(k) if R.kind_of(k) == "text" else _finite(r.get(k)) for k in keys]
                                          for r in rows])
    log_table(run, "eval/per_frame", per_frame_header(), [[_finite(x) for x in r] for r in per_frame],
              curve=("frame", "psnr", "row", "PSNR per frame index"))
    log_media(run, media)
    for r in rows:
        for c in R.COLUMNS:
            if c.summary and _finite(r.get(c.key)) is not None:
                run.summary[f"{r['sampler']}/{c.key}"] = r[c.key]


# ------------------------------------------------------------------------------------------------ media
def write_videos(cfg, gt, outputs, layout, cb, vq, out: Path) -> dict:
    """mp4 + gif of ground truth | each row's frames for the first `videos` clips -> {W&B key: path}."""
    if isinstance(vq, N.Unavailable) or cfg.videos <= 0:
        return {}
    media = {}
    space = data_action_space(cfg.data)
    for i in range(min(cfg.videos, len(gt))):
        clips = {"ground truth": gt[i]} | {label: c[i] for label, (c, _) in outputs.items() if label != "ground_truth"}
        try:
            video = comparison_frames(clips, layout, cb, vq, space)
        except ValueError as e:
            log.warning("no videos: %s", e)
            return {}
        media[f"eval/video_clip{i}"] = write_video(video, out / "videos" / f"clip{i}", cfg.fps)[1]
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
