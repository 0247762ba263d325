import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "mcar" / "conf"

# a small geometry keeps every end-to-end job to seconds on 2 CPU cores
SMALL_DATA = ["data=synthetic", "data.h=3", "data.w=4", "data.n_a=2", "data.clip_frames=3", "data.batch_size=2",
              "data.codebook_size=32", "data.action_vocab_size=8", "data.train_clips=32", "data.val_clips=2"]


def pytest_configure(config):
    """Under xdist (CI's -n 2) a progress line every 10% of the tests: count, elapsed, time left."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        from tests.progress_line import ProgressLine

        config.pluginmanager.register(ProgressLine(config), "mcar-progress-line")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _restore_environ():
    """Lightning writes os.environ as a side effect (SLURMEnvironment.main_address sets MASTER_ADDR): a test that
    leaves it set sends every later multi-process run to rendezvous with that host, where it hangs."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    saved, rank = dict(os.environ), getattr(rank_zero_only, "rank", 0)
    yield
    os.environ.clear()
    os.environ.update(saved)
    # a Trainer built with SLURM ranks (test_cluster) sets the process-wide rank_zero_only.rank: left at 3, every
    # later in-process run's CSV logger (rank-zero only) writes nothing
    rank_zero_only.rank = rank


def script_env() -> dict:
    env = dict(os.environ, WANDB_SILENT="true", WANDB_MODE="offline", HYDRA_FULL_ERROR="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def job_overrides(tmp: Path, run_dir: str = "out") -> list[str]:
    return [f"paths.checkpoint_root={tmp}/ckpt", f"hydra.run.dir={tmp}/{run_dir}", f"hydra.sweep.dir={tmp}/multi"]


def run_script(script: str, *overrides: str, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run train.py / finetune.py / python -m ... as a user would; returns the finished process."""
    cmd = [sys.executable, *(script.split() if script.startswith("-m") else [str(REPO / script)]), *overrides]
    p = subprocess.run(cmd, cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def run_in_process(main, *overrides: str):
    """A tool's `main` (e.g. mcar.tools.train.main) on these overrides in this process: the command's work without
    the seconds a fresh interpreter spends importing torch, Lightning and Hydra. As script_env: one torch thread
    (two test workers share two cores), HYDRA_FULL_ERROR=1 (a failure raises its own exception; a subprocess checks
    the one-line output of a failed command). The threads, environment and root logging the job sets (Hydra's
    handlers, which hold this test's captured stdout) are restored."""
    root, environ, threads = logging.getLogger(), dict(os.environ), torch.get_num_threads()
    handlers, level = root.handlers[:], root.level
    os.environ["HYDRA_FULL_ERROR"] = "1"
    torch.set_num_threads(1)
    try:
        return main(list(overrides))
    finally:
        torch.set_num_threads(threads)
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:], root.level = handlers, level
        os.environ.clear()
        os.environ.update(environ)


TINY_RUN = "train-tiny-synthetic-causal"  # the run name of `train.py` on SMALL_DATA


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """last.ckpt of a 2-step `train.py` run on SMALL_DATA (run TINY_RUN, checkpoint root its parents[1]), trained
    once per test process for the tests that only read a checkpoint."""
    from mcar.tools.train import main as train

    tmp = tmp_path_factory.mktemp("tiny_run")
    run_in_process(train, *SMALL_DATA, *job_overrides(tmp), "logger=none", "trainer.max_steps=2",
                   "trainer.val_check_interval=2", "val_dashboard.n_clips=0")
    return tmp / "ckpt" / TINY_RUN / "last.ckpt"


def compose(config_name: str = "train", overrides: list[str] = ()):
    """The real config, composed as Hydra would, with overrides (no output dir side effects)."""
    from mcar.hydra_app import register_resolvers

    register_resolvers()
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return hydra_compose(config_name=config_name, overrides=list(overrides))
