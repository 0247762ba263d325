"""End-to-end: train.py / finetune.py as a user runs them (subprocesses), on a small synthetic geometry."""
import csv
import re
from pathlib import Path

import hydra
import lightning as L
import numpy as np
import pytest
import torch
from hydra.errors import HydraException

from mcar.checkpoint.io import load_checkpoint
from mcar.core.layout import Layout
from mcar.core.sampler import build_sampler
from mcar.hydra_app import to_dict
from mcar.train.module import MCARModule
from mcar.train.task import build_module

from .conftest import SMALL_DATA, compose, job_overrides, run_in_process, run_script


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> train loss from the CSV logger of a run."""
    rows = csv.DictReader(open(next(run_dir.glob("csv/version_*/metrics.csv"))))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


def metrics_rows(run_dir: Path) -> list[dict]:
    return list(csv.DictReader(open(next(run_dir.glob("csv/version_*/metrics.csv")))))


PER_STEP_FLOATS = {"train/lr", "perf/tokens_per_s", "perf/step_ms", "perf/mfu"}


def test_python_floats_are_logged_only_on_the_steps_lightning_writes(tmp_path, monkeypatch):
    """Lightning makes each logged Python float a device tensor, a host-to-device copy that
    waits for the GPU. lr, throughput and MFU are logged on the steps whose log line is written (every
    log_every_n_steps), and the log lines still hold them."""
    module = build_module(compose("train", [*SMALL_DATA, "peak_flops=1e12"]))
    floats, step = [], [None]
    log = module.log

    def spy(name, value, *args, **kwargs):
        if isinstance(value, float):
            floats.append((step[0], name))
        return log(name, value, *args, **kwargs)

    class StepOfTheLine(L.Callback):  # the step a log line is written with: the steps done before this one
        def on_train_batch_start(self, trainer, *_):
            step[0] = trainer.global_step

    monkeypatch.setattr(module, "log", spy)
    batches = [{"tokens": torch.randint(0, 32, (2, Layout(3, 4, 2).n_slots(3)))} for _ in range(7)]
    trainer = L.Trainer(max_steps=7, log_every_n_steps=3, logger=L.pytorch.loggers.CSVLogger(tmp_path, name="csv"),
                        callbacks=[StepOfTheLine()], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", limit_val_batches=0)
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    written = {2, 5}  # (step + 1) % 3 == 0
    assert sorted(floats) == sorted((s, name) for s in written for name in PER_STEP_FLOATS)
    rows = metrics_rows(tmp_path)
    for name in PER_STEP_FLOATS:
        assert {int(r["step"]) for r in rows if r.get(name)} == written, name


def test_unknown_group_choice_lists_the_options():
    with pytest.raises(HydraException, match="(?s)tiny.*small|small.*tiny"):
        compose("train", ["model=huge"])


def test_train_then_finetune_keeps_the_checkpoint_model(tmp_path):
    run_script("train.py", *SMALL_DATA, *job_overrides(tmp_path, "pre"), "logger=csv", "trainer.max_steps=4",
               "trainer.val_check_interval=2")
    ckpt = tmp_path / "ckpt" / "train-tiny-synthetic-causal" / "last.ckpt"
    assert ckpt.is_file()
    # the checkpoint's own model config is kept (a model= that differs is refused: tests/test_ownership.py);
    # init_from defaults to the most trained last.ckpt
    p = run_script("finetune.py", *SMALL_DATA, *job_overrides(tmp_path, "ft"), "logger=csv", "steps=3",
                   "trainer.val_check_interval=3", "log_every_n_steps=1")
    assert f"[mcar][INFO] - fine-tuning {ckpt} (model tiny)\n" in p.stderr + p.stdout
    # finetune.yaml's rate: optim.lr=1e-4 after lr_schedule.warmup_steps=50 (train/lr is logged before the step)
    lrs = {int(r["step"]): float(r["train/lr"]) for r in metrics_rows(tmp_path / "ft") if r.get("train/lr")}
    assert lrs == pytest.approx({0: 1e-4 / 50, 1: 2e-4 / 50, 2: 3e-4 / 50}, rel=1e-6)  # logged as float32
    ft = torch.load(tmp_path / "ckpt" / "finetune-tiny-synthetic-causal" / "last.ckpt", weights_only=False)
    assert ft["global_step"] == 3
    assert ft["hyper_parameters"]["arch"]["dim"] == 128  # tiny, from the checkpoint
    assert ft["hyper_parameters"]["optim"]["lr"] == 1e-4
    assert ft["hyper_parameters"]["lr_schedule"]["warmup_steps"] == 50
    pre = torch.load(ckpt, weights_only=False)["state_dict"]
    moved = [k for k in pre if not torch.equal(pre[k], ft["state_dict"][k])]
    assert moved, "fine-tuning did not start from the checkpoint or did not train"


def val_losses(config_name: str, overrides: list[str], ckpt: Path, **schedule) -> dict[str, float]:
    """Val/loss and val/loss_diagd of a checkpoint on the run's validation clips (one batch), recomputed here with
    the module that mcar.eval.evaluate rebuilds from the checkpoint's hyperparameters (`schedule`: fields changed)."""
    cfg = compose(config_name, overrides)
    data = hydra.utils.instantiate(cfg.data, _recursive_=False)
    data.prepare_data()
    data.setup("fit")
    batches = list(data.val_dataloader())
    assert len(batches) == 1
    state = load_checkpoint(ckpt)
    hp = state["hyper_parameters"]
    module = MCARModule(**hp | {"schedule": hp["schedule"] | (schedule or {})})
    module.load_state_dict(state["state_dict"])
    with torch.no_grad():
        return {"val/loss": module.forward_loss(batches[0]["tokens"], module.val_mask_factory).item(),
                "val/loss_diagd": module.forward_loss(batches[0]["tokens"], module.val_diagd_factory).item()}


def test_finetune_with_the_diagd_mask_reports_causal_and_diagd_losses(tmp_path, tiny_checkpoint):
    """`finetune.py mask=diagd schedule.k=4` trains, validates (val/loss_diagd) and samples the
    dashboard's DiagD on k=4, the one schedule."""
    overrides = ["mask=diagd", "steps=20", *SMALL_DATA, "schedule.k=4", "val_dashboard.min_steps=0"]
    run_script("finetune.py", *overrides, *job_overrides(tmp_path, "ft"), f"init_from={tiny_checkpoint}", "logger=csv",
               "trainer.val_check_interval=10")
    val = [r for r in metrics_rows(tmp_path / "ft") if r.get("val/loss")]
    assert [int(r["step"]) for r in val] == [9, 19]
    ckpt_path = tmp_path / "ckpt" / "finetune-tiny-synthetic-diagd" / "last.ckpt"
    ckpt = torch.load(ckpt_path, weights_only=False)
    assert ckpt["global_step"] == 20 and ckpt["hyper_parameters"]["mask"]["name"] == "diagd"
    assert ckpt["hyper_parameters"]["schedule"]["k"] == 4
    module = MCARModule(**ckpt["hyper_parameters"])
    assert module.val_diagd_factory.schedule.k == module.mask_factory.schedule.k == 4
    # the last validation's losses are the final weights' on the val clips: the k=4 DiagD loss, not another k's
    want = val_losses("finetune", overrides, ckpt_path)
    for name in ("val/loss", "val/loss_diagd"):
        assert float(val[-1][name]) == pytest.approx(want[name], rel=1e-5), name
    k1 = val_losses("finetune", overrides, ckpt_path, k=1)["val/loss_diagd"]
    assert float(val[-1]["val/loss_diagd"]) != pytest.approx(k1, rel=1e-4)
    # the dashboard sampled NTP and DiagD k=4: (T-P-1)*d + s_spa passes, d = s_spa = (h-1)*k + w = 12
    s_spa = (3 - 1) * 4 + 4
    assert [float(r["val_speed/diagd_passes"]) for r in val] == [(3 - 1 - 1) * s_spa + s_spa] * 2
    assert [float(r["val_speed/ntp_passes"]) for r in val] == [2 * 3 * 4] * 2
    # the offline loss curves beside the videos hold what the CSV logger holds, and loss.png draws them
    curves = list(csv.DictReader(open(tmp_path / "ft" / "dashboard" / "metrics.csv")))
    train = {int(r["step"]): float(r["train/loss"]) for r in curves if r["train/loss"]}
    assert train == pytest.approx(losses(tmp_path / "ft"), rel=1e-6) and len(train) >= 2
    assert {int(r["step"]): float(r["val/loss"]) for r in curves if r["val/loss"]} == pytest.approx(
        {int(r["step"]): float(r["val/loss"]) for r in val}, rel=1e-6)
    from PIL import Image
    chart = np.asarray(Image.open(tmp_path / "ft" / "dashboard" / "loss.png").convert("RGB"))
    assert (chart == (31, 119, 180)).all(-1).sum() > 100 and (chart == (214, 39, 40)).all(-1).sum() > 10
    saved = torch.load(tmp_path / "ft" / "val_generations" / "step0000020.pt")
    assert sorted(saved["generated"]) == ["diagd k=4", "ntp"]
    gt = saved["ground_truth"]
    for tokens in saved["generated"].values():
        assert tokens.shape == gt.shape == (1, 3 * 14)
        assert torch.equal(tokens[:, :14], gt[:, :14])  # the prompt frame is kept
    generated = Layout(3, 4, 2).is_image(3)  # the image slots of frames 1 and 2
    generated[:14] = False
    for label, name in (("diagd k=4", "diagd"), ("ntp", "ntp")):  # token accuracy of the saved generations
        acc = (saved["generated"][label][:, generated] == gt[:, generated]).float().mean().item()
        assert float(val[-1][f"val_gen/{name}_token_acc"]) == pytest.approx(acc, abs=1e-7)


def test_bad_checkpoints_give_clear_errors(tmp_path, tiny_checkpoint):
    from mcar.tools.finetune import main as finetune
    from mcar.tools.train import main as train

    # a missing init_from names the path
    with pytest.raises(FileNotFoundError) as e:
        run_in_process(finetune, *SMALL_DATA, *job_overrides(tmp_path), "logger=none",
                       f"init_from={tmp_path}/nope.ckpt")
    assert str(e.value) == f"init_from: checkpoint not found: {tmp_path}/nope.ckpt"
    # ckpt_path=last with no run yet
    with pytest.raises(FileNotFoundError) as e:
        run_in_process(train, *SMALL_DATA, *job_overrides(tmp_path), "logger=none", "ckpt_path=last")
    run = "train-tiny-synthetic-causal"
    assert str(e.value) == f"ckpt_path: checkpoint not found: {tmp_path}/ckpt/{run}/last.ckpt (run '{run}' has no " \
                           f"last.ckpt yet)"
    # resuming a checkpoint of another model shape names the tensors that differ
    ckpt = tiny_checkpoint  # 2 steps of checkpoint.every_n_steps=100: the final state is saved at the end
    assert torch.load(ckpt, weights_only=False)["global_step"] == 2, "the final state was not saved"
    with pytest.raises(ValueError) as e:
        run_in_process(train, *SMALL_DATA, *job_overrides(tmp_path), "logger=none", "model=small", f"ckpt_path={ckpt}")
    tiny, small = (build_module(compose("train", [*SMALL_DATA, f"model={m}"])).state_dict() for m in ("tiny", "small"))
    differ = {k for k in tiny if k not in small or tiny[k].shape != small[k].shape} | set(small) - set(tiny)
    assert len(differ) == len(small) > len(tiny)  # all of tiny's tensors differ in shape; small's blocks 4-7 missing
    assert f"checkpoint {ckpt} does not fit this model ({len(differ)} tensors differ)" in str(e.value)
    assert "tok_embeddings.weight: checkpoint (40, 128) vs model (40, 512)" in str(e.value)


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    # an absurd learning rate blows the weights up within a few steps
    p = run_script("train.py", *SMALL_DATA, *job_overrides(tmp_path), "logger=none", "trainer.max_steps=200",
                   "optim.lr=1e12", "lr_schedule.warmup_steps=1", "trainer.gradient_clip_val=null",
                   "checkpoint.every_n_steps=1", check=False)
    assert p.returncode != 0
    ckpt_dir = tmp_path / "ckpt" / "train-tiny-synthetic-causal"
    found = re.findall(rf"FloatingPointError: training loss is (?:nan|inf) at step (\d+): stopping\. The last good "
                       rf"checkpoint is kept in {re.escape(str(ckpt_dir))}\.\n", p.stderr)
    assert len(found) == 1, p.stderr[-2000:]
    last = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    assert last["global_step"] == int(found[0]) > 0  # the state the failing step started from
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())


@pytest.mark.parametrize("override,field", [("schedule.k=0", "k=0"), ("mask=diagd schedule.d=999", "d=999"),
                                            ("mask=diagd schedule.proxy=left", "proxy='left'"),
                                            ("data.clip_frames=1", "frames=1")])
def test_bad_schedule_values_fail_before_training(tmp_path, override, field):
    p = run_script("train.py", *SMALL_DATA, *override.split(), *job_overrides(tmp_path), "logger=none",
                   check=False)
    cfg = compose("train", [*SMALL_DATA, *override.split()])
    with pytest.raises(ValueError, match=re.escape(field)) as e:  # the check train.py runs first
        build_sampler(to_dict(cfg.sampler), Layout(cfg.data.h, cfg.data.w, cfg.data.n_a), cfg.data.clip_frames,
                      schedule=to_dict(cfg.schedule))
    assert p.returncode != 0 and f"ValueError: {e.value}\n" in p.stderr
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
        assert f"train-{model}-synthetic-causal-j{['tiny', 'small'].index(model)}".encode() in log


class _Killed(Exception):
    pass


class _DiesAfterTheCheckpoint(L.Callback):
    """Raises when Lightning is about to log step `step - 1`'s metrics, after every on_train_batch_end hook (the
    checkpoint callbacks run last) saved step `step`: the window where a kill -9 used to lose a log line."""

    def __init__(self, step: int):
        self.step = step

    def on_train_start(self, trainer, pl_module):
        connector = trainer._logger_connector
        update = connector.update_train_step_metrics

        def dying_update():
            if trainer.global_step == self.step:
                raise _Killed()
            update()

        connector.update_train_step_metrics = dying_update


def test_a_kill_between_a_checkpoint_and_its_log_line_loses_no_step(tmp_path):
    from mcar.train.task import run

    common = [*SMALL_DATA, "logger=csv", "log_every_n_steps=1", "trainer.max_steps=12",
              "trainer.val_check_interval=1000", "checkpoint.every_n_steps=4", "val_dashboard.n_clips=0"]

    def fit(name: str, *extra: str, callbacks=()):
        cfg = compose("train", [*common, f"paths.checkpoint_root={tmp_path}/{name}_ckpt",
                                f"paths.output_dir={tmp_path}/{name}", *extra])
        Path(cfg.paths.output_dir).mkdir(parents=True, exist_ok=True)
        return run(cfg, callbacks=list(callbacks))

    fit("ref")
    # a finished run's last step was logged: its last.ckpt (step 12, a checkpoint step) carries no pending line,
    # so a run resumed from it with a larger trainer.max_steps logs nothing twice
    ref_ckpt = torch.load(tmp_path / "ref_ckpt" / "train-tiny-synthetic-causal" / "last.ckpt", weights_only=False)
    assert ref_ckpt["global_step"] == 12 and "mcar_pending_step_log" not in ref_ckpt
    with pytest.raises(_Killed):  # Lightning re-raises after its own teardown
        fit("run", callbacks=[_DiesAfterTheCheckpoint(8)])
    assert 7 not in losses(tmp_path / "run")  # the window: step 8's checkpoint is on disk, step 7's log line not
    ckpt = torch.load(tmp_path / "run_ckpt" / "train-tiny-synthetic-causal" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 8 and ckpt["mcar_pending_step_log"]["step"] == 7
    fit("resumed", "ckpt_path=last", f"paths.checkpoint_root={tmp_path}/run_ckpt")
    ref, got = losses(tmp_path / "ref"), {**losses(tmp_path / "run"), **losses(tmp_path / "resumed")}
    assert got == ref and sorted(ref) == list(range(12))
    rows = [r for r in metrics_rows(tmp_path / "resumed") if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == list(range(7, 12))  # the pending line first, then no duplicate


@pytest.mark.slow
def test_finetune_diagd_on_the_default_crafter_data(tmp_path):
    """`finetune.py mask=diagd` on the default (Crafter) data on CPU, validation reporting both
    the causal and the DiagD loss. A small Crafter set and a few steps; the commands' main in this
    process."""
    crafter = ["data=crafter", f"paths.data_dir={tmp_path}/data", "data.episodes=3", "data.frames_per_episode=12",
               "data.workers=1", "data.val_episodes=1", "data.val_clips=1", "data.clip_frames=3",
               "data.batch_size=2", "val_dashboard.max_frames=2", "val_dashboard.min_steps=0"]
    from mcar.tools.finetune import main as finetune
    from mcar.tools.train import main as train

    run_in_process(train, *crafter, *job_overrides(tmp_path, "pre"), "logger=none", "trainer.max_steps=1",
                   "val_dashboard.n_clips=0")
    run_in_process(finetune, "mask=diagd", "steps=4", *crafter, *job_overrides(tmp_path, "ft"), "logger=csv",
                   "trainer.val_check_interval=4")
    val = [r for r in metrics_rows(tmp_path / "ft") if r.get("val/loss")]
    assert len(val) == 1
    ckpt_path = tmp_path / "ckpt" / "finetune-tiny-crafter-diagd" / "last.ckpt"
    want = val_losses("finetune", ["mask=diagd", "steps=4", *crafter], ckpt_path)  # the final weights' losses
    for name in ("val/loss", "val/loss_diagd"):
        assert float(val[0][name]) == pytest.approx(want[name], rel=1e-5), name
    assert list((tmp_path / "ft" / "dashboard").glob("val_step0000004.gif")), "no validation video"
    ckpt = torch.load(ckpt_path, weights_only=False)
    assert ckpt["global_step"] == 4 and ckpt["hyper_parameters"]["arch"]["vocab_size"] == 1024 + 17


def test_piped_training_shows_progress(tmp_path):
    """Lightning's rich bar prints nothing into a pipe (nohup logs, mcar.tools.table3 stages): tqdm lines must."""
    p = run_script("train.py", *SMALL_DATA, *job_overrides(tmp_path, "train"), "trainer.max_steps=3",
                   "trainer.val_check_interval=3", "log_every_n_steps=1", "logger=none", "val_dashboard.n_clips=0")
    assert re.search(r"Epoch 0: .*3/\S+ \[", p.stdout + p.stderr), (p.stdout + p.stderr)[-2000:]


def test_a_checkpoint_carries_its_data_config_to_finetune_and_generate(tmp_path, tiny_checkpoint, capsys):
    """`finetune`, `generate` and `evaluate` (its schedule too) after `train data=synthetic ...`
    need no data= repeated (they
    used to fail: "init_from ... was trained with data.n_a=2, but this run has data.n_a=1"); an override that
    conflicts is still named. The commands' main, in this process."""
    from mcar.cli import main as mcar
    from mcar.tools.finetune import main as finetune

    ckpt = tiny_checkpoint  # train.py on SMALL_DATA
    assert torch.load(ckpt, weights_only=True)["hyper_parameters"]["data"]["n_a"] == 2
    run_in_process(finetune, *job_overrides(tmp_path, "ft"), f"init_from={ckpt}", "logger=none", "steps=1",
                   "trainer.val_check_interval=1", "val_dashboard.n_clips=0", "run_name=ft", "schedule.k=3", "seed=7")
    out = capsys.readouterr()
    assert "data as the checkpoint was trained (override with data=...)" in out.out + out.err
    tuned = tmp_path / "ckpt" / "ft" / "last.ckpt"
    hp = torch.load(tuned, weights_only=True)
    assert hp["global_step"] == 1 and hp["hyper_parameters"]["schedule"]["k"] == 3
    assert hp["hyper_parameters"]["data"]["seed"] == 7  # seed= orders the batches too (the checkpoint had 0)
    run_in_process(mcar, "generate", f"ckpt={ckpt}", "prompt=0", f"hydra.run.dir={tmp_path}/gen")
    assert list((tmp_path / "gen").glob("clip0_*.mp4"))
    # evaluate (and play, through the same loader as generate) take the data and the schedule too: k=3 here
    capsys.readouterr()
    run_in_process(mcar, "evaluate", f"ckpt={tuned}", "n_clips=2", "batch_size=2", "logger=none", "idm=null",
                   f"hydra.run.dir={tmp_path}/eval")
    out = capsys.readouterr()
    assert "data and vq and schedule as the checkpoint was trained" in out.out + out.err
    from mcar.data.files import read_json

    (row,) = read_json(tmp_path / "eval" / "results.json")["rows"]
    assert row["sampler"] == "diagd k=3" and row["clips"] == 2, row
    with pytest.raises(ValueError, match=re.escape("was trained with data.n_a=2, but this run has data.n_a=1")):
        run_in_process(finetune, *job_overrides(tmp_path, "ft2"), f"init_from={ckpt}", "logger=none", "steps=1",
                       "data.n_a=1")


def test_dashboard_token_accuracy_counts_generated_frames_only():
    """With two prompt frames the copied second prompt frame used to count as correctly generated."""
    from mcar.core.agreement import generated_agreement

    lay, frames = Layout(3, 4, 2), 4
    clips = torch.randint(0, 32, (2, lay.n_slots(frames)))
    tokens = clips.clone()
    image = lay.is_image(frames)
    last_two = torch.arange(lay.n_slots(frames)) >= lay.n_slots(2)
    tokens[:, image & last_two] = (clips[:, image & last_two] + 1) % 32  # every generated token wrong
    assert generated_agreement(tokens, clips, lay, 2).tolist() == [0.0, 0.0]
    tokens[:, image & (torch.arange(lay.n_slots(frames)) >= lay.n_slots(3))] = clips[:, image & (
        torch.arange(lay.n_slots(frames)) >= lay.n_slots(3))]  # the last frame right: half of what was generated
    assert generated_agreement(tokens, clips, lay, 2).tolist() == [0.5, 0.5]


def test_a_smoke_run_skips_the_held_out_measurement_and_says_how_to_run_it():
    """End-of-run work in proportion to the run: fewer than min_steps steps measure nothing (the summary says how
    to), and a measured run samples at most max_clips clips."""
    from types import SimpleNamespace

    from mcar.train.summary import HeldOutAgreement, summary_lines

    cb = HeldOutAgreement(min_steps=50, max_clips=2)
    trainer = SimpleNamespace(global_step=3, is_global_zero=True, loggers=[], datamodule=object())
    cb.on_train_end(trainer, SimpleNamespace(model=torch.nn.Linear(1, 1)))
    assert cb.result is None and "3 steps < callbacks.held_out_agreement.min_steps=50" in cb.skipped
    lines = summary_lines(None, 3, 0.1, None, Path("."), None, "train", cb.skipped)
    assert lines[1] == cb.skipped and "mcar evaluate" in lines[1]
    with pytest.raises(ValueError, match="max_clips=0"):
        HeldOutAgreement(max_clips=0)


def test_ckpt_path_last_falls_back_to_the_newest_step_checkpoint(tmp_path):
    """A run stopped between a step checkpoint's write and last.ckpt's resumes from its newest step checkpoint;
    last.ckpt wins when there is one; no checkpoint at all is the one-line error."""
    from omegaconf import OmegaConf

    from mcar.train.jobs import resolve_ckpt_path

    cfg = OmegaConf.create({"ckpt_path": "last", "run_name": "r", "paths": {"checkpoint_root": str(tmp_path)}})
    run = tmp_path / "r"
    run.mkdir()
    with pytest.raises(FileNotFoundError, match="has no last.ckpt yet"):
        resolve_ckpt_path(cfg)
    for step in (100, 25, 1000):
        (run / f"step{step:07d}.ckpt").write_bytes(b"x")
    (run / "step0002000.ckpt.tmp").write_bytes(b"x")  # a write in progress is not a checkpoint
    assert resolve_ckpt_path(cfg) == str(run / "step0001000.ckpt")
    (run / "last.ckpt").write_bytes(b"x")
    assert resolve_ckpt_path(cfg) == str(run / "last.ckpt")


def test_ckpt_path_last_takes_a_step_checkpoint_newer_than_last_ckpt(tmp_path):
    """A stop between a step checkpoint's write and last.ckpt's leaves last.ckpt a step behind: `last` resumes from
    the newer step checkpoint (not training the steps between again, nor writing that checkpoint twice as -v1);
    a last.ckpt at the newest step or later wins."""
    from omegaconf import OmegaConf

    from mcar.train.jobs import resolve_ckpt_path

    cfg = OmegaConf.create({"ckpt_path": "last", "run_name": "r", "paths": {"checkpoint_root": str(tmp_path)}})
    run = tmp_path / "r"
    run.mkdir()
    for step in (500, 1000):
        torch.save({"global_step": step, "state_dict": {}}, run / f"step{step:07d}.ckpt")
    torch.save({"global_step": 500, "state_dict": {}}, run / "last.ckpt")
    assert resolve_ckpt_path(cfg) == str(run / "step0001000.ckpt")
    torch.save({"global_step": 1000, "state_dict": {}}, run / "last.ckpt")
    assert resolve_ckpt_path(cfg) == str(run / "last.ckpt")
    torch.save({"global_step": 1003, "state_dict": {}}, run / "last.ckpt")  # the final step, past every N
    assert resolve_ckpt_path(cfg) == str(run / "last.ckpt")
