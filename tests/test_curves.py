"""A training run's progress by time and its slow-step hint (mcar.train.curves), on a stand-in trainer."""
import logging
import time
from types import SimpleNamespace

import pytest
import torch

from mcar.train.curves import TimeProgress, slow_step_hint
from tests.conftest import compose


def steps(progress: TimeProgress, trainer, n: int, seconds: float = 0.0) -> None:
    module = SimpleNamespace(device=torch.device("cpu"))
    for _ in range(n):
        time.sleep(seconds)
        trainer.global_step += 1
        progress.on_train_batch_end(trainer, module, None, None, 0)


def test_slow_cpu_steps_get_the_fixes_that_apply():
    trainer = SimpleNamespace(global_step=0, max_steps=1500, is_global_zero=True)
    progress = TimeProgress(every_seconds=0, slow_step_s=0.001, threads=0, model="small", hint_after_steps=3)
    progress.on_train_start(trainer, None)
    steps(progress, trainer, 3, seconds=0.01)
    assert progress.hint.startswith("slow steps: ") and "the 1497 steps left take ~" in progress.hint
    assert "threads=1" in progress.hint and "model=tiny" in progress.hint
    quick = TimeProgress(every_seconds=0, slow_step_s=10, hint_after_steps=3)
    quick.on_train_start(trainer, None)
    steps(quick, trainer, 3)
    assert quick.hint is None
    said = slow_step_hint(2.0, 60, threads=1, model="tiny")
    assert "threads=1" not in said and "model=tiny" not in said and "~2 min" in said


@pytest.mark.parametrize("job", ["train", "finetune", "posttrain"])
def test_the_slow_step_hint_offers_a_model_only_where_model_is_chosen(job):
    """Fine-tuning and post-training keep init_from's model (model= is refused there): their hint names none."""
    model = compose(job, ["model=small"]).callbacks.time_progress.model
    assert model == ("small" if job == "train" else None)


def test_a_long_first_step_is_said_by_time(caplog):
    trainer = SimpleNamespace(global_step=0, max_steps=50, is_global_zero=True)
    progress = TimeProgress(every_seconds=0.05)
    with caplog.at_level(logging.INFO, logger="mcar"):
        progress.on_train_start(trainer, None)  # stderr is captured here: no terminal, so the timer runs
        time.sleep(0.3)
        steps(progress, trainer, 2)
        time.sleep(0.2)
        progress.on_train_end(trainer, None)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training: step")]
    assert any(line.startswith("training: step 0/50, 0.0 min elapsed, the first step still running") for line in lines)
    assert any(line.startswith("training: step 2/50") and "min left" in line for line in lines)
    time.sleep(0.1)
    assert not progress._timer.is_alive()
