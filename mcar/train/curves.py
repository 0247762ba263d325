"""What a training run shows while it runs and leaves behind, offline: its loss curves (dashboard/metrics.csv and
dashboard/loss.png, written at each validation and at the end, whatever the logger) and, on a slow step, how long
the run will take and what would make it faster (a progress line by time, not only by step)."""
from __future__ import annotations

import csv
import logging
import math
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
from lightning.pytorch.callbacks import Callback
from PIL import Image, ImageDraw

log = logging.getLogger("mcar")
TRAIN_KEYS = ("train/loss", "train/lr", "perf/step_ms")
CURVE_COLOURS = {"train/loss": (31, 119, 180), "val/loss": (214, 39, 40), "val/loss_diagd": (44, 160, 44)}


class LossCurves(Callback):
    """The logged losses -> <output_dir>/dashboard/metrics.csv (one row per logged step, numbered as the loggers
    number it: step, elapsed seconds,
    train/loss, train/lr, perf/step_ms, and val/* at each validation) and loss.png (every *loss* column against
    the step), rewritten at each validation and at the end of training. Read every log_every_n_steps steps only:
    a metric's value is a host sync on CUDA."""

    def __init__(self, output_dir: str, every_n_steps: int = 10):
        self.folder = Path(output_dir) / "dashboard"
        self.every_n_steps = max(1, int(every_n_steps))
        self.rows: dict[int, dict] = {}
        self._t0 = None

    def _record(self, trainer, keys) -> None:
        metrics = trainer.callback_metrics
        step = max(trainer.global_step - 1, 0)  # the step the values belong to, numbered as Lightning's loggers do
        row = self.rows.setdefault(step, {"elapsed_s": round(time.perf_counter() - self._t0, 2)})
        for name, value in metrics.items():
            if any(name == k or name.startswith(k) for k in keys):
                row[name] = float(value)

    def on_train_start(self, trainer, pl_module) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero and trainer.global_step % self.every_n_steps == 0:
            self._record(trainer, TRAIN_KEYS)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking and self._t0 is not None:
            self._record(trainer, ("val/",))
            self.write()

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and self._t0 is not None:
            self._record(trainer, TRAIN_KEYS)
            self.write()

    def write(self) -> None:
        """metrics.csv and loss.png; a picture that fails is said and never stops the run."""
        columns = ["step", "elapsed_s", *sorted({k for row in self.rows.values() for k in row} - {"elapsed_s"})]
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / "metrics.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(columns)
            for step in sorted(self.rows):
                row = {"step": step, **self.rows[step]}
                w.writerow(["" if row.get(c) is None else row[c] for c in columns])
        curves = {c: [(s, r[c]) for s, r in sorted(self.rows.items()) if c in r and math.isfinite(r[c])]
                  for c in columns if "loss" in c}
        try:
            Image.fromarray(curve_chart({k: v for k, v in curves.items() if v})).save(self.folder / "loss.png")
        except Exception as e:  # noqa: BLE001
            log.warning("loss.png not written: %s: %s", type(e).__name__, e)


def curve_chart(curves: dict[str, list[tuple[float, float]]], size: tuple[int, int] = (640, 400)) -> np.ndarray:
    """Curves {name: [(step, value)]} -> an RGB line chart (uint8 H x W x 3): steps across, values up, the axes'
    ranges and each curve's name in its colour."""
    w, h = size
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    left, right, top, bottom = 60, w - 10, 30, h - 30
    draw.rectangle([left, top, right, bottom], outline=(0, 0, 0))
    points = [p for c in curves.values() for p in c]
    if not points:
        draw.text((left + 10, top + 10), "no loss logged yet", fill=(0, 0, 0))
        return np.asarray(img)
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1e-6)

    def at(step, value):
        return (left + (step - x0) / (x1 - x0) * (right - left), bottom - (value - y0) / (y1 - y0) * (bottom - top))

    for i, (name, curve) in enumerate(curves.items()):
        colour = CURVE_COLOURS.get(name, (120, 120, 120))
        xy = [at(s, v) for s, v in curve]
        if len(xy) > 1:
            draw.line(xy, fill=colour, width=2)
        for x, y in xy if len(xy) < 30 else xy[-1:]:
            draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=colour)
        draw.text((left + 10 + 150 * i, 8), f"{name} {curve[-1][1]:.4f}", fill=colour)
    draw.text((4, top), f"{y1:.3f}", fill=(0, 0, 0))
    draw.text((4, bottom - 10), f"{y0:.3f}", fill=(0, 0, 0))
    draw.text((left, bottom + 8), f"step {x0:g}", fill=(0, 0, 0))
    draw.text((right - 80, bottom + 8), f"step {x1:g}", fill=(0, 0, 0))
    return np.asarray(img)


class TimeProgress(Callback):
    """Progress by time as well as by step: every `every_seconds` a line with the step, the elapsed time and the
    time left at the recent pace (a background timer, so a long first step is said too; only when stderr is no
    terminal: there the bar redraws), and once, when the first steps are slower than `slow_step_s` on CPU, what
    makes them faster (threads=1 on a shared machine, a smaller model)."""

    def __init__(self, every_seconds: float = 60, slow_step_s: float = 1.0, threads: int | None = 0,
                 model: str | None = None, hint_after_steps: int = 5):
        self.every_seconds, self.slow_step_s, self.threads, self.model = every_seconds, slow_step_s, threads, model
        self.hint_after_steps = hint_after_steps
        self._step_s: list[float] = []
        self._last = self._t0 = None
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self.hint: str | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._t0 = self._last = time.perf_counter()
        self._first_step = trainer.global_step
        if trainer.is_global_zero and self.every_seconds and not sys.stderr.isatty():
            self._stop.clear()
            self._timer = threading.Thread(target=self._every, args=(trainer,), daemon=True, name="mcar-progress")
            self._timer.start()

    def _every(self, trainer) -> None:
        while not self._stop.wait(self.every_seconds):
            log.info("%s", self.line(trainer.global_step, trainer.max_steps))

    def line(self, step: int, max_steps: int) -> str:
        """'training: step S/N, M min elapsed, ~L min left (X s a step)' (the pace: the median recent step)."""
        elapsed = time.perf_counter() - self._t0
        out = f"training: step {step}/{max_steps if max_steps > 0 else '?'}, {elapsed / 60:.1f} min elapsed"
        if not self._step_s:
            return out + f", the first step still running ({time.perf_counter() - self._last:.0f} s)"
        pace = statistics.median(self._step_s[-20:])
        left = f", ~{(max_steps - step) * pace / 60:.1f} min left" if max_steps > 0 else ""
        return out + f"{left} ({pace:.2f} s a step)"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self._step_s.append(now - self._last)
        self._last = now
        done = trainer.global_step - self._first_step
        if self.hint is None and done == self.hint_after_steps and trainer.is_global_zero:
            pace = statistics.median(self._step_s[1:])  # the first step carries set-up
            if pace > self.slow_step_s and pl_module.device.type == "cpu":
                self.hint = slow_step_hint(pace, trainer.max_steps - trainer.global_step, self.threads, self.model)
                log.warning("%s", self.hint)

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop.set()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._stop.set()


def slow_step_hint(pace: float, steps_left: int, threads: int | None, model: str | None) -> str:
    """What to do about slow CPU steps: how long the rest takes at this pace, and the fixes that apply."""
    left = f"the {steps_left} steps left take ~{steps_left * pace / 60:.0f} min at this pace" if steps_left > 0 \
        else "at this pace"
    fixes = []
    if threads != 1:
        fixes.append("threads=1 (on a shared or busy CPU one thread is often several times faster: "
                     "BENCHMARKS.md, threads)")
    if model not in (None, "tiny"):
        fixes.append("model=tiny (the smallest model)")
    fixes.append(("or " if fixes else "") + "a GPU")
    return f"slow steps: {pace:.1f} s each on CPU, {left}; faster: {', '.join(fixes)}"
