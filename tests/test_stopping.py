"""Stop signals end a run within seconds in every phase (mcar/stopping.py): a real `python train.py` gets SIGTERM or
SIGINT while it builds data, trains, validates, or measures at the end; it exits with 128 + the signal's number,
keeps its whole checkpoints, and resumes from them."""
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from .conftest import REPO, job_overrides, script_env

TINY = ["model=tiny", "logger=none", "run_name=stop"]
SYNTHETIC = ["data=synthetic", "data.h=3", "data.w=4", "data.n_a=2", "data.clip_frames=3", "data.codebook_size=32",
             "data.action_vocab_size=8", "data.batch_size=2"]
SLOW_NTP = ["data.h=14", "data.w=24", "sampler=ntp"]  # 336 passes a frame: sampling outlasts the signal


def started(tmp: Path, *overrides: str) -> tuple[subprocess.Popen, queue.Queue]:
    """`python train.py` in its own process, its output lines in a queue as they come."""
    cmd = [sys.executable, str(REPO / "train.py"), *TINY, *job_overrides(tmp), f"paths.data_dir={tmp}/data",
           *overrides]
    proc = subprocess.Popen(cmd, cwd=tmp, env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return proc, lines


def wait_for(proc, lines: queue.Queue, seen: list, ready, timeout: float = 240) -> None:
    t0 = time.time()
    while not ready(seen):
        assert proc.poll() is None, "".join(seen)[-3000:]
        assert time.time() - t0 < timeout, "".join(seen)[-3000:]
        try:
            seen.append(lines.get(timeout=0.1))
        except queue.Empty:
            pass


def stop(proc, lines: queue.Queue, seen: list, signum: int) -> float:
    """Send `signum`; -> seconds until the process exited."""
    t0 = time.time()
    proc.send_signal(signum)
    try:
        proc.wait(timeout=60)
    finally:
        proc.kill()
    dt = time.time() - t0
    while not lines.empty():
        seen.append(lines.get())
    return dt


PHASES = {  # phase -> (overrides, when to send the signal)
    "data build": (["data=crafter", "data.episodes=40", "data.workers=1", "trainer.max_steps=2"],
                   lambda tmp, out: any((tmp / "data").rglob("*.mp4"))),
    "training steps": ([*SYNTHETIC, "trainer.max_steps=100000", "checkpoint.every_n_steps=5",
                        "val_dashboard.n_clips=0"],
                       # last.ckpt is written just after the step's: a signal between the two left no last.ckpt
                       # to resume from (seen once in CI)
                       lambda tmp, out: any((tmp / "ckpt" / "stop").glob("step*.ckpt"))
                       and (tmp / "ckpt" / "stop" / "last.ckpt").exists()),
    "validation sampling": ([*SYNTHETIC, *SLOW_NTP, "trainer.max_steps=100000", "trainer.val_check_interval=2",
                             "data.clip_frames=6", "val_dashboard.n_clips=4", "val_dashboard.max_frames=6",
                             "val_dashboard.min_steps=0", "checkpoint.every_n_steps=2"],
                            lambda tmp, out: "Validation" in out),
    "end-of-run measurement": ([*SYNTHETIC, *SLOW_NTP, "trainer.max_steps=2", "data.clip_frames=8",
                                "val_dashboard.min_steps=0", "data.val_clips=8",
                                "trainer.val_check_interval=1000"],
                               lambda tmp, out: "held-out agreement: greedy" in out),
}


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(PHASES))
def test_a_stop_signal_ends_the_run_within_seconds(tmp_path, phase):
    overrides, ready = PHASES[phase]
    signum = signal.SIGINT if phase == "validation sampling" else signal.SIGTERM
    proc, lines = started(tmp_path, *overrides)
    seen: list[str] = []
    wait_for(proc, lines, seen, lambda s: ready(tmp_path, "".join(s)))
    seconds = stop(proc, lines, seen, signum)
    out = "".join(seen)
    assert proc.returncode == 128 + signum, out[-3000:]
    assert seconds < 15, f"{phase}: {seconds:.1f} s to stop"
    assert f"stopped by {signal.Signals(signum).name}" in out and "Traceback" not in out, out[-3000:]
    ckpts = sorted((tmp_path / "ckpt" / "stop").glob("*.ckpt"))
    assert not list((tmp_path / "ckpt" / "stop").glob("*.tmp")), "a checkpoint write left its temp file"
    for ckpt in ckpts:  # whole, never half-written
        assert "state_dict" in torch.load(ckpt, map_location="cpu", weights_only=True)
    if phase == "training steps":  # the stop's line names the checkpoint and the command; finished work resumes
        assert f"kept {tmp_path / 'ckpt' / 'stop' / 'last.ckpt'}; resume with: mcar train" in out, out[-3000:]
        assert "run_name=stop ckpt_path=last" in out, out[-3000:]
        again = [o for o in overrides if not o.startswith("trainer.max_steps")]
        resumed = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY, *job_overrides(tmp_path, "again"),
                                  *again, "trainer.max_steps=6", "ckpt_path=last"], cwd=tmp_path,
                                 env=script_env(), capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-3000:]


def test_the_stop_line_says_what_the_job_keeps(tmp_path, capsys):
    """A stop inside a job that says what it keeps (on_stop_say) prints that, the innermost job's word first; a
    training run names its last checkpoint and the resume command (or that none is written yet)."""
    from omegaconf import OmegaConf

    from mcar.stopping import Stopped, on_stop_say, stop_signals_end
    from mcar.train.jobs import stop_note

    with pytest.raises(SystemExit) as e, stop_signals_end("train"), on_stop_say("outer"), on_stop_say(lambda: "inner"):
        raise Stopped(signal.SIGINT)
    assert e.value.code == 130 and capsys.readouterr().err.strip() == "mcar train: stopped by SIGINT: inner"
    cfg = OmegaConf.create({"task": "finetune", "run_name": "ft-2", "checkpoint": {"every_n_steps": 5, "dir": None},
                            "paths": {"checkpoint_root": str(tmp_path)}})
    assert stop_note(cfg).startswith(f"no checkpoint yet in {tmp_path / 'ft-2'} (the first at step 5)")
    (tmp_path / "ft-2").mkdir()
    (tmp_path / "ft-2" / "last.ckpt").write_bytes(b"")
    assert stop_note(cfg, "pre/last.ckpt") == (f"kept {tmp_path / 'ft-2' / 'last.ckpt'}; resume with: mcar finetune "
                                               f"init_from=pre/last.ckpt run_name=ft-2 ckpt_path=last")


def test_plays_stop_line_is_its_own():
    from omegaconf import OmegaConf

    from mcar.tools.play import stop_note

    note = stop_note(OmegaConf.create({"host": "127.0.0.1"}))
    assert "games are not saved" in note and "mcar play" in note and "ckpt_path" not in note
