"""Soak test: kill -9 a training run at random moments, resume it each time, compare with an uninterrupted run.

    mcar soak kills=10 every=20 out=outputs/soak trainer.max_steps=20000 [train.py overrides ...]

Runs `train.py` uninterrupted (the reference, alongside), and again from scratch, killing it with SIGKILL at
`kills` random moments (each after a random step's checkpoint, a random part of a checkpoint interval later) and
resuming each time from its last checkpoint until it finishes; trainer.max_steps sets the length (and so the time).
Every step's loss of the killed-and-resumed run (the last
value logged for a step: a resume repeats the steps after its checkpoint) must equal the reference bit for bit,
as must the final weights. Writes <out>/soak.json (kills, steps, mismatches, seconds) and prints it; exits 1 on a
mismatch. Any train.py override may follow (e.g. model=tiny data=synthetic trainer.max_steps=4000).
"""
from __future__ import annotations

import csv
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from mcar.atomic import write_json
from mcar.checkpoint.io import load_checkpoint
from mcar.hydra_app import compose_tool
from mcar.tool_help import usage_exit

DEFAULTS = ["model=tiny", "data=synthetic", "logger=csv", "log_every_n_steps=1", "trainer.val_check_interval=1000",
            "val_dashboard.n_clips=0"]


def step_losses(run_dir: Path) -> dict[int, str]:
    """step -> train/loss as logged (text: compared exactly), the last value wins, over every metrics.csv."""
    out = {}
    for f in sorted(run_dir.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime):
        with open(f) as fh:
            for row in csv.DictReader(fh):
                if row.get("train/loss"):
                    out[int(row["step"])] = row["train/loss"]
    return out


def resume_from(ckpt_dir: Path) -> list[str]:
    """ckpt_path for the next start: last.ckpt, else the newest step checkpoint (a kill between writing a step
    checkpoint and last.ckpt), else none (a fresh start: killed before the first checkpoint)."""
    if (ckpt_dir / "last.ckpt").exists():
        return ["ckpt_path=last"]
    steps = sorted(ckpt_dir.glob("step*.ckpt"))
    return [f"ckpt_path={steps[-1]}"] if steps else []


def final_state(ckpt: Path) -> dict:
    return load_checkpoint(ckpt)["state_dict"]


def newest_step(ckpt_dir: Path) -> int:
    steps = [int(p.stem[4:]) for p in ckpt_dir.glob("step*.ckpt") if p.stem[4:].isdigit()]
    return max(steps, default=0)


def soak(out: Path, kills: int, overrides: list[str], seed: int = 0, every: int = 20) -> dict:
    """`kills` kills at random moments: kill i waits for the checkpoint at or after a random step (kill steps drawn
    uniformly over the run, sorted), then for a random fraction of a checkpoint interval, then sends SIGKILL."""
    rng, targets = _kill_plan(overrides, kills, seed, every)
    out.mkdir(parents=True, exist_ok=True)
    train = [sys.executable, "-m", "mcar.cli", "train", *DEFAULTS, f"checkpoint.every_n_steps={every}", *overrides]
    env = {**os.environ, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1"}
    # the reference runs alongside (its own process, same seed): the comparison is step by step afterwards
    reference = subprocess.Popen([*train, f"paths.checkpoint_root={out}/ref_ckpt", "run_name=soak",
                                  f"hydra.run.dir={out}/ref"], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
    ckpt_dir = out / "ckpt" / "soak"
    t1 = time.time()
    killed, starts, kill_steps = _kill_and_resume(train, env, out, ckpt_dir, targets, rng, every, t1)
    soak_s = time.time() - t1
    if reference.wait() != 0:
        raise RuntimeError(f"the reference run failed; see {out}/ref")
    ref, got = step_losses(out / "ref"), step_losses(out / "killed")
    mismatches = [s for s in ref if got.get(s) != ref[s]]
    a, b = final_state(out / "ref_ckpt" / "soak" / "last.ckpt"), final_state(ckpt_dir / "last.ckpt")
    weights_equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    result = dict(kills=killed, starts=starts, kill_after_checkpoint_steps=kill_steps, steps=len(ref),
                  steps_compared=len(got), mismatches=len(mismatches),
                  first_mismatch=mismatches[0] if mismatches else None, final_weights_equal=weights_equal,
                  soak_seconds=round(soak_s, 1), overrides=overrides)
    write_json(out / "soak.json", result)
    return result


def _kill_plan(overrides: list[str], kills: int, seed: int, every: int) -> tuple[random.Random, list[int]]:
    """-> (the rng that also draws each kill's delay, the sorted steps after which the kills come)."""
    max_steps = next((int(o.split("=", 1)[1]) for o in overrides if o.startswith("trainer.max_steps=")), None)
    if not max_steps or max_steps < 4 * every:
        raise ValueError(f"soak needs trainer.max_steps=<steps> >= 4 x every={every} among the overrides")
    rng = random.Random(seed)
    # kill steps leave the last three checkpoint intervals alone: a kill must land before the run ends
    span = range(every, max_steps - 3 * every + 1)
    return rng, sorted(rng.sample(span, min(kills, len(span))))


def _kill_and_resume(train: list[str], env: dict, out: Path, ckpt_dir: Path, targets: list[int],
                     rng: random.Random, every: int, t1: float) -> tuple[int, int, list[int]]:
    """Starts (and resumes) the run until it finishes, killing it once per target. -> (kills, starts, kill steps)."""
    killed, starts, kill_steps = 0, 0, []
    # seconds a checkpoint interval takes, timed between two checkpoints of one process: from a start to its first
    # checkpoint includes its start-up, and a wait of up to 0.8x that on a busy machine outlasted the run's end
    interval = 1.0
    while True:
        (out / "killed").mkdir(exist_ok=True)
        with open(out / "killed" / f"{starts:03d}.stderr", "wb") as stderr:  # why a start failed, when one does
            proc = subprocess.Popen([*train, f"paths.checkpoint_root={out}/ckpt", "run_name=soak",
                                     f"hydra.run.dir={out}/killed/{starts:03d}", *resume_from(ckpt_dir)],
                                    env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        starts += 1
        if killed < len(targets):
            interval = _wait_for_step(proc, ckpt_dir, targets[killed], every, interval)
            time.sleep(rng.uniform(0, 0.8 * interval))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                killed += 1
                kill_steps.append(newest_step(ckpt_dir))
                print(f"kill {killed}/{len(targets)} after checkpoint step {kill_steps[-1]} "
                      f"({time.time() - t1:.0f} s)", flush=True)
                continue
        if proc.wait() != 0:
            raise RuntimeError(f"the resumed run failed (start {starts}); see {out}/killed/{starts - 1:03d} and "
                               f"{out}/killed/{starts - 1:03d}.stderr")
        return killed, starts, kill_steps


def _wait_for_step(proc: subprocess.Popen, ckpt_dir: Path, target: int, every: int, interval: float) -> float:
    """Waits until a checkpoint at or after `target` exists (or the run ends). -> seconds per checkpoint interval,
    re-timed when this process writes a second checkpoint."""
    seen, t_seen = newest_step(ckpt_dir), None
    while proc.poll() is None:
        step = newest_step(ckpt_dir)
        if step > seen:
            if t_seen is not None:  # this process's second checkpoint or later: how long an interval takes
                interval = (time.time() - t_seen) * every / (step - seen)
            seen, t_seen = step, time.time()
        if step >= target:
            break
        time.sleep(0.05)
    return interval


def main(argv: list[str] | None = None) -> None:
    """conf/soak.yaml's keys (kills, every, seed, out) are soak's; every other override goes to train."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        usage_exit("soak")
    own = set(compose_tool("soak", []))
    mine = [a for a in argv if a.split("=", 1)[0] in own]
    c = compose_tool("soak", mine)
    result = soak(Path(c.out), int(c.kills), [a for a in argv if a not in mine], int(c.seed), int(c.every))
    print(json.dumps(result))
    if result["mismatches"] or not result["final_weights_equal"] or result["steps_compared"] < result["steps"]:
        sys.exit(1)
