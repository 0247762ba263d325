"""The columns of `mcar evaluate`'s results, one entry each: its key, header, digits, which way is better, how
its per-clip values pool into the row's value (then a bootstrap interval over clips comes with it), whether it
has a per-frame curve, shows in the terminal or the W&B summary, and what it means. scoring.py, reporting.py
(results.{csv,md,json}, the terminal table, W&B) and `mcar table3` all read this list: a new token metric is one
entry here (`tokens=`); a pixel or IDM metric is an entry here plus its per-clip values in scoring.score."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mcar.core.agreement import generated_agreement
from mcar.eval import metrics as M
from mcar.tokenizer.quality import psnr_from_mse

CI_RESAMPLES, CI_LEVEL = 1000, 0.95  # the bootstrap interval: resamples of the clips, central share


def mean_of(values):
    return values.mean(-1)


def psnr_of_mean_mse(values):
    return psnr_from_mse(values.mean(-1))


@dataclass(frozen=True)
class Column:
    key: str  # the row's key in results.json / results.csv
    title: str = ""  # table header; "": the key
    digits: int = 2
    better: str | None = None  # "higher" | "lower"; None: not a score (a fact of the run, or neither way)
    kind: str = "float"  # float | int | text
    pool: Callable | None = None  # (..., clips) per-clip values -> the row's value; set: <key>_lo/_hi, a CI
    tokens: Callable | None = None  # (generated, real, layout, codebook_size, prompt_frames) -> (clips,) values
    per_frame: bool = False  # a curve over the generated frames (per_frame.csv, W&B plot)
    terminal: bool = False  # in the narrow table the terminal shows
    summary: bool = False  # in the W&B run summary
    means: str = ""  # the glossary: what the number is

    @property
    def header(self) -> str:
        return self.title or self.key


def _token_acc(gen, gt, layout, codebook_size, prompt_frames):
    return generated_agreement(gen, gt, layout, prompt_frames)


def _unchanged(gen, gt, layout, codebook_size, prompt_frames):
    return M.unchanged_per_clip(gen, layout, codebook_size, prompt_frames)


COLUMNS: tuple[Column, ...] = (
    Column("model", kind="text", means="the checkpoint's run name"),
    Column("sampler", kind="text", terminal=True,
           means="the sampler and its schedule, or a reference row (ground_truth, copy_last, noise)"),
    Column("token_acc", digits=3, better="higher", pool=mean_of, tokens=_token_acc, terminal=True, summary=True,
           means="share of generated image tokens equal to the real ones"),
    Column("fvd", "FVD", better="lower", summary=True, means="Frechet video distance of I3D features (fvd.i3d=)"),
    Column("psnr", "PSNR", better="higher", pool=psnr_of_mean_mse, per_frame=True, terminal=True, summary=True,
           means="dB of the decoded frames vs the real ones, MSE pooled over clips"),
    Column("ssim", "SSIM", digits=3, better="higher", pool=mean_of, per_frame=True, summary=True,
           means="structural similarity to the real frames"),
    Column("lpips", "LPIPS", digits=3, better="lower", pool=mean_of, per_frame=True, summary=True,
           means="perceptual distance to the real frames (lpips=)"),
    Column("subject_consistency", "SUBJ", digits=3, better="higher", pool=mean_of, summary=True,
           means="VBench's subject consistency: DINO features of each generated frame against the one before and "
                 "the last prompt frame (vbench.dino=)"),
    Column("dynamic_degree", "DYN", digits=3, pool=mean_of, summary=True,
           means="VBench's dynamic degree: share of clips whose RAFT optical flow (top 5% per frame pair, from the "
                 "last prompt frame on) moves past VBench's threshold; not a score: the ground truth's is the aim "
                 "(copy_last: 0) (vbench.raft=)"),
    Column("imaging_quality", "IMG", digits=3, better="higher", pool=mean_of, summary=True,
           means="VBench's imaging quality: MUSIQ (SPAQ) score / 100 of each generated frame (vbench.musiq=)"),
    Column("unchanged", digits=3, pool=mean_of, tokens=_unchanged, summary=True,
           means="share of generated image tokens equal to the frame before (copy_last: 1)"),
    Column("action_f1", digits=3, better="higher", terminal=True, summary=True,
           means="the IDM's macro F1 on generated frame pairs vs the conditioning actions"),
    Column("action_acc", digits=3, better="higher", pool=mean_of, means="the IDM's accuracy on generated pairs"),
    Column("action_f1_gt", digits=3, better="higher", means="the IDM's macro F1 on the real pairs (its ceiling)"),
    Column("loss_tf", digits=3, better="lower", summary=True,
           means="teacher-forced cross-entropy of the generated image tokens on the sampler's schedule"),
    Column("fps", "FPS", better="higher", terminal=True, summary=True, means="generated frames per second"),
    Column("tp", "TP", digits=0, better="higher", summary=True, means="generated image tokens per second"),
    Column("step", "STEP", kind="int", better="lower", summary=True, means="forward passes per clip"),
    Column("clips", kind="int", means="held-out clips scored"),
    Column("frames", kind="int", means="frames per clip, prompt included"),
    Column("prompt_frames", kind="int", means="prompt frames (given, not scored)"),
    Column("notes", kind="text", means="why a column reads n/a"),
)


MOVE_WORDS = {"prec": "precision", "rec": "recall"}


def move_column(key: str) -> Column | None:
    """prec_<move> / rec_<move>: the IDM's precision / recall of one movement action of the data's action space
    (its own names; data without movement actions has none of these columns)."""
    kind, _, move = key.partition("_")
    if kind not in MOVE_WORDS or not move:
        return None
    return Column(key, better="higher", means=f"the IDM's {MOVE_WORDS[kind]} of {move} on generated pairs")


def columns(rows: list[dict] = ()) -> list[Column]:
    """The registry's columns, each data's per-move precision/recall (the prec_/rec_ keys its rows carry) after
    action_f1_gt."""
    moves = [move_column(k) for k in (rows[0] if rows else {}) if move_column(k) is not None]
    at = next(i for i, c in enumerate(COLUMNS) if c.key == "action_f1_gt") + 1
    return [*COLUMNS[:at], *moves, *COLUMNS[at:]]


def column(key: str) -> Column:
    for c in COLUMNS:
        if c.key == key:
            return c
    moved = move_column(key)
    if moved is not None:
        return moved
    raise KeyError(f"{key!r} is not a results column (mcar/eval/metric_registry.py)")


def with_ci() -> list[Column]:
    """The columns with per-clip values: each comes with a bootstrap interval <key>_lo, <key>_hi."""
    return [c for c in COLUMNS if c.pool is not None]


def csv_keys(rows: list[dict] = ()) -> list[str]:
    """Every column of results.csv and a row of results.json (`columns(rows)`), in order: each CI column followed
    by its bounds."""
    return [k for c in columns(rows) for k in ((c.key, f"{c.key}_lo", f"{c.key}_hi") if c.pool else (c.key,))]


def kind_of(key: str) -> str:
    """float | int | text of a csv key (a bound reads as its column's number)."""
    for c in COLUMNS:
        if key in (c.key, f"{c.key}_lo", f"{c.key}_hi"):
            return "float" if key != c.key else c.kind
    return "float"


def number(v):
    """A finite or infinite int/float, else None (None, Unavailable, a reason written as text, a bool)."""
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def cell(row: dict, key: str, ci: bool = True) -> str:
    """One table cell: the value at the column's digits ('n/a' without one), then [low, high] when the row has
    its bootstrap interval (and the interval is not a single point)."""
    c = column(key)
    v = row.get(key)
    if c.kind == "text":
        return "" if v is None else str(v)
    if number(v) is None:
        return "n/a"
    text = M.fmt(float(v) if c.kind == "float" else v, c.digits)
    lo, hi = number(row.get(f"{key}_lo")), number(row.get(f"{key}_hi"))
    if ci and lo is not None and hi is not None and not lo == hi == v:
        text += f" [{M.fmt(float(lo), c.digits)}, {M.fmt(float(hi), c.digits)}]"
    return text


ARROWS = {"higher": " ↑", "lower": " ↓", None: ""}  # which way is better, in the glossary


def glossary(keys) -> str:
    """'token_acc ↑: ...; PSNR ↑: ...' for the given column keys, one line (the arrow: which way is better)."""
    return "; ".join(f"{column(k).header}{ARROWS[column(k).better]}: {column(k).means}" for k in keys)


def ci_note() -> str:
    return (f"[low, high]: {CI_LEVEL:.0%} bootstrap interval over clips ({CI_RESAMPLES} resamples, seeded by "
            f"`seed`)")
