"""The Lightning internals mcar.train.callbacks.Checkpoints reads (Lightning has no public API for them), pinned:
while a step's checkpoint is written (on_train_batch_end), `fit_loop.epoch_loop._batches_that_stepped` is the
step before `global_step`, `_logger_connector.should_update_logs` says whether this step's line is still to be
logged, and `_logger_connector.metrics["log"]` holds that line. A Lightning release that changes any of these
fails here by name (and pyproject's lightning range stops below the first release not checked)."""
import re
from importlib.metadata import requires, version

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from packaging.specifiers import SpecifierSet

LOG_EVERY = 3


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def training_step(self, batch, batch_idx):
        loss = (self.w * batch).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Record(Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        connector = trainer._logger_connector
        self.seen.append((trainer.global_step, trainer.fit_loop.epoch_loop._batches_that_stepped,
                          connector.should_update_logs, dict(connector.metrics["log"])))


def test_the_installed_lightning_is_in_the_declared_range():
    spec = next(r for r in requires("mcar") if re.match(r"lightning\b", r))
    assert version("lightning") in SpecifierSet(spec.removeprefix("lightning").split(";")[0])


def test_checkpoint_time_logger_state_is_what_checkpoints_reads(tmp_path):
    record = Record()
    trainer = L.Trainer(max_steps=7, log_every_n_steps=LOG_EVERY, logger=L.pytorch.loggers.CSVLogger(tmp_path),
                        callbacks=[record], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.fit(Tiny(), torch.utils.data.DataLoader(torch.arange(1.0, 9.0), batch_size=1))
    assert [s[0] for s in record.seen] == list(range(1, 8))
    for step, stepped, should_log, metrics in record.seen:
        assert stepped == step - 1  # the step's log line is not written yet
        assert should_log == (step % LOG_EVERY == 0)
        assert set(metrics) == {"train/loss"}
