"""cluster=slurm: Hydra's submitit launcher sends sweep jobs to SLURM, each one a Lightning multi-node job.

The real config is composed with its hydra node, the real launcher is built from it and asked to launch; only
submitit's submission (sbatch) is replaced by a capture, so the sbatch script the cluster would get is checked.
"""
import os

import pytest
import submitit  # the test extra installs hydra-submitit-launcher: a missing plugin fails here, not skips
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.types import RunMode
from hydra.utils import instantiate

from .conftest import CONF

SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def compose_with_hydra(config_name: str, overrides: list[str]):
    from mcar.hydra_app import register_resolvers

    register_resolvers()

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF), job_name=config_name):
        return hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=True)


def sbatch_script(cfg, monkeypatch) -> tuple[str, int]:
    """The sbatch script the submitit launcher built from cfg for a two-job sweep, and its number of jobs."""
    captured = {}

    def capture(executor, fn, *iterables):
        captured["executor"], captured["n_jobs"] = executor, len(iterables[0])
        return []

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", capture)
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 2))  # as if srun were here
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=None, config=cfg)
    assert launcher.launch([["model=tiny"], ["model=small"]], initial_job_idx=0) == []
    ex = captured["executor"]._executor
    assert isinstance(ex, submitit.SlurmExecutor)
    return ex._make_submission_file_text("python -u -m submitit.core._submit", "uid"), captured["n_jobs"]


def test_default_config_keeps_the_basic_launcher():
    cfg = compose_with_hydra("train", [])
    assert cfg.hydra.launcher._target_ == BASIC_LAUNCHER
    assert "cluster" not in cfg


@pytest.mark.parametrize("config_name", ["train", "finetune"])
@pytest.mark.parametrize("devices,num_nodes", [(4, 2), (2, 3)])
def test_slurm_jobs_get_one_task_per_device_on_each_node(config_name, devices, num_nodes, tmp_path, monkeypatch):
    cfg = compose_with_hydra(config_name, [
        "cluster=slurm", "cluster.partition=gpu", "cluster.account=lab", "cluster.mem_gb=200",
        "trainer=ddp", f"trainer.devices={devices}", f"trainer.num_nodes={num_nodes}",
        f"hydra.sweep.dir={tmp_path}/multi"])
    launcher = cfg.hydra.launcher
    assert launcher._target_ == SLURM_LAUNCHER
    assert cfg.hydra.mode == RunMode.MULTIRUN  # cluster=slurm submits with or without -m
    # what Lightning checks under SLURM: ntasks-per-node == devices, nodes == num_nodes
    assert (launcher.tasks_per_node, launcher.gpus_per_node, launcher.nodes) == (devices, devices, num_nodes)
    assert cfg.trainer.strategy == "ddp"

    script, n_jobs = sbatch_script(cfg, monkeypatch)
    assert n_jobs == 2
    for line in [f"--ntasks-per-node={devices}", f"--gpus-per-node={devices}", f"--nodes={num_nodes}",
                 "--partition=gpu", "--account=lab", "--mem=200GB", "--time=1440", "--cpus-per-task=8"]:
        assert f"#SBATCH {line}\n" in script, (line, script)
    assert f"#SBATCH --output={tmp_path}/multi/.submitit/%j/" in script
    assert "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK" in script
    assert "\nsrun " in script  # one srun starts every task: Lightning's SLURMEnvironment reads its ranks


def test_each_srun_task_becomes_its_lightning_rank(monkeypatch):
    """What a task of such a job sees: SLURM's variables (set by srun), from which Lightning's auto-detected
    SLURMEnvironment takes its ranks; trainer=ddp needs nothing more. A task count that differs from
    trainer.devices is refused by Lightning, which is why the launcher takes it from trainer.devices."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    cfg = compose_with_hydra("train", ["cluster=slurm", "trainer=ddp", "trainer.devices=2", "trainer.num_nodes=2",
                                       "trainer.accelerator=cpu", "logger=none"])
    slurm = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": str(cfg.hydra.launcher.tasks_per_node),
             "SLURM_NNODES": str(cfg.hydra.launcher.nodes), "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
             "SLURM_NODEID": "1", "SLURM_NODELIST": "gpu[7-8]", "SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "train"}
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    trainer = instantiate(cfg.trainer, logger=False, _convert_="partial")
    env = trainer.strategy.cluster_environment
    assert isinstance(env, SLURMEnvironment)
    assert (trainer.world_size, trainer.global_rank, trainer.local_rank, trainer.node_rank) == (4, 3, 1, 1)
    assert env.main_address == "gpu7" and env.creates_processes_externally
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # launch() sets it otherwise
    assert trainer.strategy.launcher.launch(lambda: "fit") == "fit"  # fit's first step: checks, spawns nothing

    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8")
    trainer = instantiate(cfg.trainer, logger=False, _convert_="partial")
    with pytest.raises(ValueError, match="ntasks-per-node=8"):
        trainer.strategy.launcher.launch(lambda: "fit")
