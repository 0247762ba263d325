"""World tests every environment shares: a model's rollouts from a simulator's own frames and actions, against
the baselines (copy_last: nothing moves; an oracle where the environment has one, e.g. Crafter's start frame
scrolled by the true movement), teacher-forced memory windows, and each score's 95% bootstrap interval over starts
(mcar.eval.stats), paired start by start between rows and between runs.

The environment is any mcar.data.environment.Environment: `rollout_test` plays `starts` fresh worlds (seed
`seed_base + i`) with a policy, tokenises the frames with the model's VQ and scores the rows. A world's own tests
(Crafter's loops, shapes, collisions and creatures: mcar/crafter/world_tests.py) build on the same rows, scores and
reports.
"""
from __future__ import annotations

import csv
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from mcar.atomic import written_atomically
from mcar.core.agreement import frame_agreement, histogram_distance, nothing_moves
from mcar.core.layout import Layout
from mcar.data.environment import Environment
from mcar.eval.stats import interval, paired_interval
from mcar.tokenizer.clips import join_clip
from mcar.tokenizer.vq_model import encode_tokens


# ------------------------------------------------------------------------------------------------ clips
@dataclass
class Episode:
    """What an environment showed in the world of `seed`: frame t (H, W, 3) uint8 seen before action t (the last
    action a noop, never used), and its info after each step."""

    seed: int
    frames: list = field(default_factory=list)
    actions: list = field(default_factory=list)
    infos: list = field(default_factory=list)


def record_episode(env: Environment, seed: int, steps: int, policy: Callable) -> Episode | None:
    """`steps` actions of `policy(frame) -> action` from a fresh world (env.reset(seed)), the frames recorded; None
    when the episode ends first (info["done"])."""
    ep = Episode(seed, [env.reset(seed)])
    for _ in range(steps):
        action = int(policy(ep.frames[-1]))
        frame, info = env.step(action)
        if info.get("done"):
            return None
        ep.frames.append(frame)
        ep.actions.append(action)
        ep.infos.append(info)
    ep.actions.append(0)
    return ep


class Tokens:
    """Frames -> clips with the data's VQ."""

    def __init__(self, vq, layout: Layout, codebook_size: int, batch: int = 64):
        self.vq, self.layout, self.cb, self.batch = vq, layout, codebook_size, batch

    def images(self, frames) -> torch.Tensor:
        x = torch.from_numpy(np.stack(frames))
        return torch.cat([encode_tokens(self.vq, b.to(self.vq.device)).cpu() for b in x.split(self.batch)])

    def clip(self, rec) -> torch.Tensor:
        """A recording (its .frames, .actions) -> its (N,) clip."""
        return join_clip(self.images(rec.frames), torch.tensor(rec.actions)[:, None], self.cb)


def images_of(clips: torch.Tensor, layout: Layout) -> torch.Tensor:
    """(B, N) clips -> (B, T, h, w) image tokens."""
    x = clips.view(clips.shape[0], -1, layout.frame_len)[..., :layout.frame_tokens]
    return x.reshape(*x.shape[:2], layout.h, layout.w)


def invented_share(frames: torch.Tensor, real: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """frames, real (B, T, h, w) generated and real image codes, prompt (B, P, h, w) the prompt frames -> (B, T)
    share of each generated frame's tiles whose code is in neither the real frame at that step nor any prompt
    frame: tile types the model made up (0 for a frame that only rearranges what it was shown or what is there)."""
    B, T = frames.shape[:2]
    size = int(max(frames.max(), real.max(), prompt.max())) + 1
    seen = torch.zeros(B, T, size, dtype=torch.bool)
    seen.scatter_(2, real.flatten(2), True)
    shown = torch.zeros(B, size, dtype=torch.bool)
    shown.scatter_(1, prompt.flatten(1), True)
    seen |= shown[:, None]
    return (~seen.gather(2, frames.flatten(2))).double().mean(-1)


# ------------------------------------------------------------------------------------------------ the rows
class ModelRows:
    """The rows every world test compares, from one checkpoint (a WorldModel): the model on each of `windows`
    (default its own context and the smallest a rolling window allows, 2 frames: the frame being made and the one
    before), optionally teacher-forced, copy_last and real."""

    def __init__(self, wm, windows=None, prompt: int = 1, batch_size: int = 8):
        self.wm, self.layout, self.cb, self.vq = wm, wm.layout, wm.codebook_size, wm.vq
        self.context, self.prompt, self.batch_size = wm.context, int(prompt), int(batch_size)
        self.windows = [int(w) for w in windows] if windows else [self.context, 2]

    def generate(self, clips: torch.Tensor, context: int | None = None,
                 prompt_frames: int | None = None) -> torch.Tensor:
        """clips generated from their first prompt_frames frames (None: the schedule's) on a window of `context`
        frames (None: the model's)."""
        frames = clips.shape[1] // self.layout.frame_len
        schedule = None if prompt_frames is None else {"prompt_frames": prompt_frames}
        sampler = self.wm.sampler(frames, context=context, schedule=schedule)
        return self.wm.generate(clips, sampler, self.batch_size)[0]

    @torch.no_grad()
    def teacher_forced(self, clips: torch.Tensor, context: int) -> torch.Tensor:
        """clips with the last frame's image tokens the model's greedy guess from the real frames before it, on a
        window of `context` frames (one causal pass): what its memory holds, with no sampled frame in the way."""
        fl, ft = self.layout.frame_len, self.layout.frame_tokens
        frames = clips.shape[1] // fl
        window = min(context, frames)
        x, out = clips[:, (frames - window) * fl:], clips.clone()
        coords = self.layout.coords(window).to(self.wm.device)
        last = (window - 1) * fl  # the last frame's first slot in the window; slot s is predicted at s - 1
        for i in range(0, len(x), self.batch_size):
            logits = self.wm.model(x[i:i + self.batch_size].to(self.wm.device), coords)
            guess = logits[:, last - 1:last - 1 + ft, :self.cb].argmax(-1)
            out[i:i + len(guess), (frames - 1) * fl:(frames - 1) * fl + ft] = guess.to(out)
        return out

    def rows_for(self, clips: torch.Tensor, teacher_forced: bool = False) -> dict[str, torch.Tensor]:
        """{row: (B, N) clips}: the model on each window, copy_last, real; teacher_forced: also the model's last
        frame from the real ones on each window."""
        forced = {f"model context={w} teacher-forced": self.teacher_forced(clips, w) for w in self.windows} \
            if teacher_forced else {}
        return {**{f"model context={w}": self.generate(clips, w) for w in self.windows}, **forced,
                "copy_last": nothing_moves(clips, self.layout, 1), "real": clips}


def score_rollouts(rows: dict[str, torch.Tensor], clips: torch.Tensor, layout: Layout, codebook_size: int,
                   prompt: int, seed: int, bands: dict[str, slice] | None = None) -> tuple[dict, dict]:
    """{row: (B, N) generated clips} against the real `clips` -> (per row: token agreement, mean over steps and at
    the last, `tv` (the tile-mix distance), `invented` tiles and each band's agreement (`bands`: {name: image rows},
    e.g. Crafter's map and inventory; one of no rows is NaN in the curve and left out of the means), each with its
    interval over starts; per row the curve, one entry per step)."""
    every = images_of(clips, layout)
    real = every[:, 1:]
    out, curves = {}, {}
    for name, gen in rows.items():
        images = images_of(gen, layout)[:, 1:]
        per = frame_agreement(gen, clips, layout)[:, 1:]  # (B, T-1)
        tv = histogram_distance(images, real, codebook_size)  # (B, T-1)
        band = {k: (images[:, :, rows_] == real[:, :, rows_]).double().flatten(2).mean(-1)
                if images[:, :, rows_].numel() else torch.full_like(per, float("nan"))
                for k, rows_ in (bands or {}).items()}  # (B, T-1) each
        invented = invented_share(images, real, every[:, :prompt])  # (B, T-1)
        curves[name] = [interval(per[:, k], seed) | {"tv": float(tv[:, k].mean())} |
                        {b: float(v[:, k].mean()) for b, v in band.items()} |
                        {"invented": float(invented[:, k].mean())} for k in range(per.shape[1])]
        out[name] = {"mean": interval(per.mean(1), seed), "last": interval(per[:, -1], seed),
                     "tv_mean": interval(tv.mean(1), seed), "tv_last": interval(tv[:, -1], seed),
                     **{f"{b}_mean": interval(v.mean(1), seed) for b, v in band.items() if not v.isnan().all()},
                     "invented_mean": interval(invented.mean(1), seed),
                     "invented_last": interval(invented[:, -1], seed)}
    return out, curves


def rollout_test(rows: ModelRows, tokens: Tokens, env: Environment, policy: Callable, starts: int, frames: int,
                 seed_base: int, seed: int, oracle: Callable | None = None) -> tuple[dict, dict]:
    """The world test any environment takes: `starts` fresh worlds (seeds from seed_base; a world whose episode ends
    before `frames` frames is skipped for the next seed), `frames` - 1 actions of `policy` each, generated from the
    first frame(s) and every action -> score_rollouts' (scores, curves) of the model rows, copy_last and, where the
    environment has one, `oracle(clips, episodes) -> clips` (a baseline the model must beat, row "oracle")."""
    episodes, world = [], seed_base
    while len(episodes) < starts:
        if world - seed_base > 20 * starts + 20:
            raise RuntimeError(f"only {len(episodes)} of {starts} worlds lasted {frames} frames: fewer frames")
        ep = record_episode(env, world, frames - 1, policy)
        world += 1
        if ep is not None:
            episodes.append(ep)
    clips = torch.stack([tokens.clip(ep) for ep in episodes])
    made = rows.rows_for(clips)
    made.pop("real")
    if oracle is not None:
        made["oracle"] = oracle(clips, episodes)
    return score_rollouts(made, clips, rows.layout, rows.cb, rows.prompt, seed)


# ------------------------------------------------------------------------------------------------ reports
def ci_cell(d: dict | None) -> str:
    """A table cell: the mean and its interval ('n/a' without a mean, '(one start)' without an interval)."""
    if not d or "mean" not in d:
        return "n/a"
    if d.get("lo") is None:  # one start: no interval
        return f"{d['mean']:.3f} (one start)"
    return f"{d['mean']:.3f} [{d['lo']:.3f}, {d['hi']:.3f}]"


def write_curves(curves: dict, path: Path) -> tuple[list[str], list[list]]:
    """The per-step curves as a CSV (row, step, agreement, lo, hi, then the curve's other columns) -> (columns,
    table)."""
    first = next((per[0] for per in curves.values() if per), {})
    extra = [k for k in first if k not in ("mean", "lo", "hi", "n", "per_start")]
    columns = ["row", "step", "agreement", "lo", "hi", *extra]
    table = [[name, k + 1, c["mean"], c["lo"], c["hi"], *(c[e] for e in extra)]
             for name, per in curves.items() for k, c in enumerate(per)]
    with written_atomically(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows(table)
    return columns, table


def baseline_margins(rollout: dict, seed: int, keys=("mean", "map_mean", "inventory_mean")) -> list[dict]:
    """Each model row's rollout scores (`keys`) minus each baseline's (every row but the model's and the real
    frames: copy_last, an oracle), paired start by start, each a mean and its 95% bootstrap interval."""
    out = []
    bases = [row for row in rollout if not row.startswith("model") and row != "real"]
    for row, v in rollout.items():
        if not row.startswith("model"):
            continue
        for base in bases:
            m = {"row": row, "baseline": base}
            for key in keys:
                a, b = v.get(key), rollout[base].get(key)
                if a and b and "per_start" in a and "per_start" in b:
                    m[key] = paired_interval(a["per_start"], b["per_start"], seed)
            out.append(m)
    return out


def _far_is_all(*rows: dict) -> bool:
    """Whether each row's far-tile recall is its whole recall, start by start (every tile the walk hid was far)."""
    return all((r.get("recall") or {}).get("per_start") == (r.get("recall_far") or {}).get("per_start") for r in rows)


def window_row(row: str) -> str:
    """The 2-frame window's row a model row's memory is measured against: of its own kind (teacher-forced or not)."""
    return "model context=2" + (" teacher-forced" if row.endswith(" teacher-forced") else "")


def window_gains(res: dict, seed: int) -> list[dict]:
    """What memory buys: each loop's and shape's recall for every model row with a longer window minus the 2-frame
    window's (which cannot see the start frame at the end), paired start by start, with a 95% bootstrap interval
    over starts: recall "clearly above the 2-frame window" is an interval clear of 0."""
    walks = [(f"loop n={n}", rows) for n, rows in res.get("loops", {}).items()]
    walks += [(f"shape {name}", v.get("rows", {})) for name, v in res.get("shapes", {}).items()]
    out = []
    for (walk, rows), key in itertools.product(walks, ("recall", "recall_far")):
        for row, r in rows.items():
            short, mine = rows.get(window_row(row), {}).get(key) or {}, r.get(key) or {}
            if not row.startswith("model") or row == window_row(row) or "per_start" not in mine \
                    or "per_start" not in short:
                continue
            if key == "recall_far" and _far_is_all(r, rows.get(window_row(row), {})):
                continue  # a wait hides only far tiles: the same numbers as the walk's own row
            out.append({"walk": walk + (" (far tiles)" if key == "recall_far" else ""), "row": row,
                        **paired_interval(mine["per_start"], short["per_start"], seed)})
    return out


def paired_versus(mine: dict, theirs: dict, seed: int) -> list[dict]:
    """This run's rows minus another run's (`versus`: its world_tests.json), start by start (the same seed_base and
    starts: the same worlds and actions), each with a 95% bootstrap interval over starts: the rollout's agreement
    (mean, last step), map, inventory and invented tiles, each event of `creatures` rows but the real frames', each
    loop's and shape's recall, and each shape's memory gain (memory_gain_pairs)."""
    pairs = []
    for name, row in mine.get("rollout", {}).items():
        for key in ("mean", "last", "map_mean", "inventory_mean", "invented_mean", "tv_mean"):
            pairs.append((f"rollout {name}: {key}", row.get(key), theirs.get("rollout", {}).get(name, {}).get(key)))
    for name, row in mine.get("creatures", {}).get("rows", {}).items():
        for key in [k for k in row if not k.endswith("_minus_real")] if name != "real" else ():
            pairs.append((f"creatures {name}: {key}", row.get(key),
                          theirs.get("creatures", {}).get("rows", {}).get(name, {}).get(key)))
    for n, rows in mine.get("loops", {}).items():
        for name, r in rows.items():
            pairs.append((f"loop {n} {name}: recall", r.get("recall"),
                          theirs.get("loops", {}).get(str(n), {}).get(name, {}).get("recall")))
    for shape, v in mine.get("shapes", {}).items():
        their_rows = theirs.get("shapes", {}).get(shape, {}).get("rows", {})
        for name, r in v.get("rows", {}).items():
            for key in ("recall", "recall_far"):
                pairs.append((f"shape {shape} {name}: {key}", r.get(key), their_rows.get(name, {}).get(key)))
        pairs += memory_gain_pairs(f"shape {shape}", v.get("rows", {}), their_rows)
    out = []
    for what, a, b in pairs:
        if not a or not b or "per_start" not in a or "per_start" not in b or len(a["per_start"]) != len(b["per_start"]):
            continue
        d = paired_interval(a["per_start"], b["per_start"], seed)
        out.append({"what": what, "mine": a["mean"], "theirs": b["mean"], "difference": d["mean"], "lo": d["lo"],
                    "hi": d["hi"], "n": d["n"]})
    return out


def memory_gain_pairs(walk: str, mine: dict, theirs: dict) -> list[tuple]:
    """What memory buys in each run (a model row's recall minus its 2-frame window's, start by start), to pair one
    run's against the other's: a far-tile gain only where it is not the whole recall (as window_gains)."""
    def gain(rows: dict, row: str, short: str, key: str) -> dict | None:
        a, b = (rows.get(row) or {}).get(key) or {}, (rows.get(short) or {}).get(key) or {}
        if not a.get("per_start") or len(a["per_start"]) != len(b.get("per_start") or []):
            return None
        per_start = [x - y for x, y in zip(a["per_start"], b["per_start"])]
        return {"mean": sum(per_start) / len(per_start), "per_start": per_start}

    out = []
    for row in mine:
        short = window_row(row)
        if not row.startswith("model") or row == short:
            continue
        for key in ("recall", "recall_far"):
            if key == "recall_far" and _far_is_all(mine.get(row, {}), mine.get(short, {})):
                continue
            out.append((f"{walk} {row}: {key} minus the 2-frame window's", gain(mine, row, short, key),
                        gain(theirs, row, short, key)))
    return out


def versus_markdown(rows: list[dict], versus: str) -> str:
    lines = [f"This run minus {versus}, start by start (95% bootstrap interval over starts):", "",
             "| measure | this run | versus | difference |", "|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['mine']:.3f} | {r['theirs']:.3f} | {r['difference']:+.3f} [{r['lo']:+.3f}, "
              f"{r['hi']:+.3f}] |" for r in rows]
    return "\n".join(lines) + "\n"
