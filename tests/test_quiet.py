"""A first short run reads cleanly: no start-up notice flood (mcar/train/quiet.py lists each and where it is
stopped), progress as lines in a pipe, and a dashboard picture at its end even when it is shorter than
val_check_interval's 100 steps."""
import io

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger

from .conftest import SMALL_DATA, compose, job_overrides, run_script

FLOOD = ["litlogger", "limit_val_batches", "exists and is not empty", "Total FLOPs", "LeafSpec",
         "anonymous setting", "HYDRA_FULL_ERROR", "Run history:", "Run summary:", "done: {"]


def test_a_short_piped_run_is_quiet_and_ends_with_a_dashboard_picture(tmp_path):
    p = run_script("train.py", *SMALL_DATA, "model=tiny", "trainer.max_steps=4", "log_every_n_steps=1",
                   "val_dashboard.min_steps=0",
                   *job_overrides(tmp_path))  # logger=wandb (offline), the default; stdout and stderr are pipes
    out = p.stdout + p.stderr
    said = [s for s in FLOOD if s in out]
    assert not said, f"the run still says {said}:\n{out[-4000:]}"
    assert "\r" not in out and "\x1b[A" not in out, "progress redraws in place in a pipe"
    assert any(line.startswith("Epoch 0: 100%") for line in out.splitlines())  # the bar, one line per redraw
    dashboard = tmp_path / "out" / "dashboard"
    assert (dashboard / "val_step0000004.mp4").is_file() and (dashboard / "mask_train.png").is_file()
    assert (dashboard / "loss.png").is_file() and "loss curves (train/loss " in out  # offline, with W&B on
    assert compose("train", []).trainer.val_check_interval == 100
    assert compose("train", ["trainer.max_steps=-1"]).trainer.val_check_interval == 100


def test_line_progress_turns_redraws_into_lines():
    from mcar.progress import LineProgress

    sink = io.StringIO()
    s = LineProgress(sink)
    for text in ["\rbar 1/3", "\rbar 2/3", "\rbar 3/3", "\n", "log line\n", "\r\x1b[Anested 1/2", "\rnested 2/2\n"]:
        s.write(text)
    assert sink.getvalue() == "bar 1/3\nbar 2/3\nbar 3/3\nlog line\nnested 1/2\nnested 2/2\n"
    # a log line on stdout while the bar's line on stderr is open (both into one file): it starts a line of its own
    one_file, peers = io.StringIO(), []
    bar, logs = LineProgress(one_file, peers), LineProgress(one_file, peers)
    bar.write("\rEpoch 0: 10/150")
    logs.write("[mcar][INFO] - training: step 15/150\n")
    bar.write("\rEpoch 0: 20/150")
    bar.write("\n")
    assert one_file.getvalue() == "Epoch 0: 10/150\n[mcar][INFO] - training: step 15/150\nEpoch 0: 20/150\n"


def test_the_library_internals_quiet_reaches_are_still_there(tmp_path):
    """Lightning's name-mangled directory check and WandbLogger's init dict (pinned like test_lightning_privates)."""
    from mcar.train.callbacks import Checkpoints
    from mcar.train.quiet import wandb_logger

    assert callable(getattr(ModelCheckpoint, "_ModelCheckpoint__warn_if_dir_not_empty", None))
    assert "_ModelCheckpoint__warn_if_dir_not_empty" in vars(Checkpoints)
    assert "anonymous" in WandbLogger(save_dir=str(tmp_path), mode="offline")._wandb_init
    logger = wandb_logger(save_dir=str(tmp_path), mode="offline", project="p")
    assert "anonymous" not in logger._wandb_init and logger._wandb_init["project"] == "p"
    assert logger._wandb_init["settings"] == {"quiet": True}  # W&B's closing panel: the run's summary says it
