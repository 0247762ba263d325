"""End-to-end: train.py / finetune.py as a user runs them (subprocesses), on a small synthetic geometry."""
import csv
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra.errors import HydraException
from hypothesis import given, strategies as st

from mcar.train.module import warmup_cosine

from .conftest import REPO, SMALL_DATA, compose, job_overrides, run_script, script_env


def losses(run_dir: Path) -> dict[int, float]:
    """step -> train loss from the CSV logger of a run."""
    rows = csv.DictReader(open(next(run_dir.glob("csv/version_*/metrics.csv"))))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


@given(st.integers(0, 5000), st.integers(1, 100), st.integers(1, 5000), st.floats(0, 1))
def test_warmup_cosine_bounds(step, warmup, total, min_ratio):
    f = warmup_cosine(step, warmup, total, min_ratio)
    assert min(min_ratio, 1 / warmup) - 1e-9 <= f <= 1 + 1e-9
    if step + 1 < warmup:
        assert f < warmup_cosine(step + 1, warmup, total, min_ratio)  # linear warm-up rises
    if warmup < total and step >= total:
        assert math.isclose(f, min_ratio, abs_tol=1e-9)


def test_unknown_group_choice_lists_the_options():
    with pytest.raises(HydraException, match="(?s)tiny.*small|small.*tiny"):
        compose("train", ["model=huge"])


def test_train_then_finetune_keeps_the_checkpoint_model(tmp_path):
    run_script("train.py", *SMALL_DATA, *job_overrides(tmp_path, "pre"), "logger=csv", "trainer.max_steps=4",
               "trainer.val_check_interval=2")
    ckpt = tmp_path / "ckpt" / "train-tiny-synthetic-causal" / "last.ckpt"
    assert ckpt.is_file()
    # model=small is overridden by the checkpoint's own config; init_from defaults to the newest last.ckpt
    p = run_script("finetune.py", *SMALL_DATA, *job_overrides(tmp_path, "ft"), "logger=csv", "steps=3",
                   "model=small", "trainer.val_check_interval=3")
    assert "fine-tuning" in p.stderr + p.stdout
    ft = torch.load(tmp_path / "ckpt" / "finetune-tiny-synthetic-causal" / "last.ckpt", weights_only=False)
    assert ft["global_step"] == 3
    assert ft["hyper_parameters"]["arch"]["dim"] == 128  # tiny, from the checkpoint
    pre = torch.load(ckpt, weights_only=False)["state_dict"]
    moved = [k for k in pre if not torch.equal(pre[k], ft["state_dict"][k])]
    assert moved, "fine-tuning did not start from the checkpoint or did not train"


def test_finetune_with_the_diagd_mask_reports_causal_and_diagd_losses(tmp_path):
    run_script("train.py", *SMALL_DATA, *job_overrides(tmp_path, "pre"), "logger=none", "trainer.max_steps=2",
               "val_dashboard.n_clips=0")
    run_script("finetune.py", "mask=diagd", "steps=20", *SMALL_DATA, *job_overrides(tmp_path, "ft"),
               "logger=csv", "trainer.val_check_interval=10", "schedule.k=1")
    rows = list(csv.DictReader(open(next((tmp_path / "ft").glob("csv/version_*/metrics.csv")))))
    val = [r for r in rows if r.get("val/loss")]
    assert len(val) == 2 and all(r["val/loss_diagd"] for r in val)
    s_spa = (3 - 1) * 1 + 4  # (h-1)*k + w with k=1
    assert [float(r["val_speed/diagd_passes"]) for r in val] == [(3 - 1 - 1) * s_spa + s_spa] * 2
    assert [float(r["val_speed/ntp_passes"]) for r in val] == [2 * 3 * 4] * 2
    assert all(0 <= float(r["val_gen/diagd_token_acc"]) <= 1 for r in val)
    saved = torch.load(tmp_path / "ft" / "val_generations" / "step0000020.pt")
    assert sorted(saved["generated"]) == ["diagd k=1", "ntp"]
    for tokens in saved["generated"].values():
        assert tokens.shape == saved["ground_truth"].shape == (1, 3 * 14)
        assert torch.equal(tokens[:, :14], saved["ground_truth"][:, :14])  # the prompt frame is kept
    ckpt = torch.load(tmp_path / "ckpt" / "finetune-tiny-synthetic-diagd" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 20 and ckpt["hyper_parameters"]["mask"]["name"] == "diagd"


def test_bad_checkpoints_give_clear_errors(tmp_path):
    # a missing init_from names the path
    p = run_script("finetune.py", *SMALL_DATA, *job_overrides(tmp_path), "logger=none",
                   f"init_from={tmp_path}/nope.ckpt", check=False)
    assert p.returncode != 0 and f"{tmp_path}/nope.ckpt" in p.stderr
    # ckpt_path=last with no run yet
    p = run_script("train.py", *SMALL_DATA, *job_overrides(tmp_path), "logger=none", "ckpt_path=last", check=False)
    assert p.returncode != 0 and "last.ckpt" in p.stderr
    # resuming a checkpoint of another model shape names the tensors that differ
    run_script("train.py", *SMALL_DATA, *job_overrides(tmp_path), "logger=none", "trainer.max_steps=1")
    ckpt = tmp_path / "ckpt" / "train-tiny-synthetic-causal" / "last.ckpt"
    assert torch.load(ckpt, weights_only=False)["global_step"] == 1, "the final state was not saved"
    p = run_script("train.py", *SMALL_DATA, *job_overrides(tmp_path), "logger=none", "model=small",
                   f"ckpt_path={ckpt}", check=False)
    assert p.returncode != 0 and "does not fit this model" in p.stderr
    assert "tok_embeddings.weight: checkpoint (40, 128) vs model (40, 512)" in p.stderr


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    # an absurd learning rate blows the weights up within a few steps
    p = run_script("train.py", *SMALL_DATA, *job_overrides(tmp_path), "logger=none", "trainer.max_steps=200",
                   "optim.lr=1e12", "optim.warmup_steps=1", "trainer.gradient_clip_val=null",
                   "checkpoint.every_n_steps=1", check=False)
    assert p.returncode != 0
    assert "training loss is nan at step" in p.stderr or "training loss is inf at step" in p.stderr
    last = torch.load(tmp_path / "ckpt" / "train-tiny-synthetic-causal" / "last.ckpt", weights_only=False)
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())


@pytest.mark.parametrize("override,field", [("schedule.k=0", "k=0"), ("mask=diagd schedule.d=999", "d=999"),
                                            ("mask=diagd schedule.proxy=left", "proxy='left'"),
                                            ("data.clip_frames=1", "clip_frames")])
def test_bad_schedule_values_fail_before_training(tmp_path, override, field):
    p = run_script("train.py", *SMALL_DATA, *override.split(), *job_overrides(tmp_path), "logger=none",
                   check=False)
    assert p.returncode != 0 and field in p.stderr
    assert not (tmp_path / "ckpt").exists(), "work started before the config was checked"


def test_multirun_gives_one_run_dir_checkpoint_dir_and_wandb_run_per_job(tmp_path):
    run_script("train.py", "-m", "model=tiny,small", "trainer.max_steps=3", "trainer.val_check_interval=3",
               *SMALL_DATA, *job_overrides(tmp_path))
    ckpts = sorted(p.parent.name for p in (tmp_path / "ckpt").glob("*/last.ckpt"))
    assert ckpts == ["train-small-synthetic-causal-j1", "train-tiny-synthetic-causal-j0"]
    runs = sorted((tmp_path / "multi").glob("*/wandb/offline-run-*"))
    assert len(runs) == 2 and runs[0].parent.parent != runs[1].parent.parent
    for run, model in zip(runs, ["tiny", "small"]):  # each run carries its own resolved config
        log = next(run.glob("*.wandb")).read_bytes()
        assert b"run_name" in log and f"train-{model}-synthetic-causal-j".encode() in log


@pytest.mark.slow
def test_resume_after_kill_9_is_exact(tmp_path):
    common = [*SMALL_DATA, "logger=csv", "log_every_n_steps=1", "trainer.max_steps=300",
              "trainer.val_check_interval=1000", "checkpoint.every_n_steps=40"]
    ref_dir, kill_dir, resume_dir = tmp_path / "ref", tmp_path / "killed", tmp_path / "resumed"
    run_script("train.py", *common, f"paths.checkpoint_root={tmp_path}/ref_ckpt", f"hydra.run.dir={ref_dir}")

    cmd = [sys.executable, str(REPO / "train.py"), *common, f"paths.checkpoint_root={tmp_path}/ckpt",
           f"hydra.run.dir={kill_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=script_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt_dir = tmp_path / "ckpt" / "train-tiny-synthetic-causal"
    deadline = time.time() + 300
    while not list(ckpt_dir.glob("step0000080.ckpt")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed_from = torch.load(ckpt_dir / "last.ckpt", weights_only=False)["global_step"]
    assert 40 <= resumed_from < 300, f"kill came too late (last checkpoint at step {resumed_from})"

    run_script("train.py", *common, f"paths.checkpoint_root={tmp_path}/ckpt", f"hydra.run.dir={resume_dir}",
               "ckpt_path=last")
    ref, got = losses(ref_dir), losses(resume_dir)
    after = [s for s in got if s >= resumed_from]
    assert len(after) >= 300 - resumed_from - 1 and after[-1] == 299
    for s in after:
        assert got[s] == ref[s], f"step {s}: resumed loss {got[s]} != uninterrupted {ref[s]}"


@pytest.mark.slow
def test_ddp_two_processes_see_different_data(tmp_path):
    run_script("train.py", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=4",
               "trainer.val_check_interval=4", "record_seen_clips=true", "logger=csv", *SMALL_DATA,
               *job_overrides(tmp_path))
    seen = {}
    for rank in (0, 1):
        lines = (tmp_path / "out" / f"seen_clips_rank{rank}.txt").read_text().split("\n")
        seen[rank] = {int(l.split()[0]): set(map(int, l.split()[1:])) for l in lines if l}
    assert sorted(seen[0]) == sorted(seen[1]) == [1, 2, 3, 4]  # global step after each batch
    for step in seen[0]:
        assert not seen[0][step] & seen[1][step], f"step {step}: both ranks trained on the same clips"


@pytest.mark.slow
def test_finetune_diagd_on_the_default_crafter_data(tmp_path):
    """The issue's check: `finetune.py mask=diagd` on the default (Crafter) data, 20 steps on CPU, validation
    reporting both the causal and the DiagD loss. A small Crafter set keeps it to about a minute."""
    crafter = ["data=crafter", f"paths.data_dir={tmp_path}/data", "data.episodes=3", "data.frames_per_episode=24",
               "data.workers=1", "data.val_episodes=1", "data.val_clips=1", "data.clip_frames=3",
               "data.batch_size=2", "val_dashboard.max_frames=2"]
    run_script("train.py", *crafter, *job_overrides(tmp_path, "pre"), "logger=none", "trainer.max_steps=2",
               "val_dashboard.n_clips=0")
    run_script("finetune.py", "mask=diagd", "steps=20", *crafter, *job_overrides(tmp_path, "ft"), "logger=csv",
               "trainer.val_check_interval=20")
    rows = list(csv.DictReader(open(next((tmp_path / "ft").glob("csv/version_*/metrics.csv")))))
    val = [r for r in rows if r.get("val/loss")]
    assert len(val) == 1 and float(val[0]["val/loss"]) > 0 and float(val[0]["val/loss_diagd"]) > 0
    assert list((tmp_path / "ft" / "dashboard").glob("val_step0000020.gif")), "no validation video"
    ckpt = torch.load(tmp_path / "ckpt" / "finetune-tiny-crafter-diagd" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 20 and ckpt["hyper_parameters"]["arch"]["vocab_size"] == 1024 + 17


def test_piped_training_shows_progress(tmp_path):
    """Lightning's rich bar prints nothing into a pipe (nohup logs, mcar.eval.table3 stages): tqdm lines must."""
    p = run_script("train.py", *SMALL_DATA, *job_overrides(tmp_path, "train"), "trainer.max_steps=3",
                   "trainer.val_check_interval=3", "log_every_n_steps=1", "logger=none", "val_dashboard.n_clips=0")
    assert re.search(r"Epoch 0: .*3/\S+ \[", p.stdout + p.stderr), (p.stdout + p.stderr)[-2000:]
