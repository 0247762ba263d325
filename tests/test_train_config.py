"""The training task from the real config (conf/, composed as Hydra does): the optimiser (conf/optim/), the lr
schedule (conf/lr_schedule/), the callbacks (conf/callbacks/) and the module's arguments (the `module` node)."""
import math
import sys

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar

from mcar.train.callbacks import Checkpoints, SeenClips, build_callbacks
from mcar.train.module import MCARModule
from mcar.train.task import build_module, build_trainer

from .conftest import SMALL_DATA, compose


def optimizer_and_lrs(overrides: list[str], steps: int) -> tuple[torch.optim.Optimizer, list[float]]:
    """The configured module's optimiser and the lr of its first group at steps 0..steps (as Lightning steps it)."""
    module = build_module(compose("train", [*SMALL_DATA, *overrides]))
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    assert conf["lr_scheduler"]["interval"] == "step"
    lrs = []
    for _ in range(steps + 1):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return opt, lrs


def test_the_optimizer_is_the_configured_adamw_with_decay_on_2d_weights_only():
    module = build_module(compose("train", SMALL_DATA))
    opt = module.configure_optimizers()["optimizer"]
    assert type(opt) is torch.optim.AdamW
    decay, no_decay = opt.param_groups
    for group, wd in ((decay, 0.1), (no_decay, 0.0)):
        assert (group["initial_lr"], group["betas"], group["weight_decay"], group["eps"]) == (1e-3, (0.9, 0.95), wd,
                                                                                               1e-8)
        assert group["fused"] is True  # no trainer attached: not fp16
    named = dict(module.model.named_parameters())
    want_decay = {n for n, p in named.items() if p.dim() == 2}
    assert {n for n, p in named.items() if p.dim() > 2} == set()
    ids = {id(p): n for n, p in named.items()}
    assert {ids[id(p)] for p in decay["params"]} == want_decay
    assert {ids[id(p)] for p in no_decay["params"]} == set(named) - want_decay
    assert all(n.endswith("norm.weight") for n in set(named) - want_decay) and len(named) > len(want_decay)


def test_optim_overrides_change_the_optimizer():
    module = build_module(compose("train", [*SMALL_DATA, "optim.lr=1e-3", "optim.weight_decay=0.05",
                                            "optim.betas=[0.8,0.9]"]))
    decay, no_decay = module.configure_optimizers()["optimizer"].param_groups
    assert (decay["initial_lr"], decay["betas"], decay["weight_decay"], no_decay["weight_decay"]) == (
        1e-3, (0.8, 0.9), 0.05, 0.0)
    assert module.hparams.optim == {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3,
                                    "betas": [0.8, 0.9], "weight_decay": 0.05, "eps": 1e-8}


def test_fp16_gets_a_non_fused_adamw(monkeypatch):
    module = build_module(compose("train", SMALL_DATA))
    trainer = type("T", (), {"precision": "16-mixed"})()
    monkeypatch.setattr(MCARModule, "trainer", property(lambda self: trainer))
    module._trainer = trainer
    assert [g["fused"] for g in module.configure_optimizers()["optimizer"].param_groups] == [False, False]
    module.optim_config["fused"] = True
    with pytest.raises(ValueError, match="optim.fused=true under trainer.precision=16-mixed"):
        module.configure_optimizers()


def test_warmup_cosine_schedule_from_the_config():
    # warm-up from the model config (model.warmup_steps), cosine to min_lr_ratio=0.1 at trainer.max_steps
    _, lrs = optimizer_and_lrs(["model.warmup_steps=4", "trainer.max_steps=10"], 12)
    lr = 1e-3  # tiny's model.lr
    assert lrs[0] == pytest.approx(lr / 4, rel=1e-12)  # step 0: (0 + 1) / warmup
    assert lrs[3] == pytest.approx(lr, rel=1e-12)  # the end of the warm-up: the full rate
    assert lrs[4] == pytest.approx(lr, rel=1e-12)  # the cosine starts at 1
    assert lrs[7] == pytest.approx(lr * (0.1 + 0.9 * 0.5), rel=1e-12)  # half way: cos(pi / 2) = 0
    assert lrs[10] == lrs[11] == lrs[12] == pytest.approx(lr * 0.1, rel=1e-12)  # max_steps and after: lr * 0.1
    for s in range(4, 11):
        assert lrs[s] == pytest.approx(lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (s - 4) / 6))), rel=1e-12)
    _, lrs = optimizer_and_lrs(["lr_schedule.warmup_steps=2", "lr_schedule.min_lr_ratio=0", "trainer.max_steps=4",
                                "optim.lr=1e-3"], 4)
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4, 0.0], abs=1e-15)


def test_constant_schedule_is_flat():
    _, lrs = optimizer_and_lrs(["lr_schedule=constant", "trainer.max_steps=5"], 6)
    assert lrs == [1e-3] * 7
    assert compose("train", [*SMALL_DATA, "model=small"]).optim.lr == 3e-4  # no model.lr: the paper's
    _, lrs = optimizer_and_lrs(["lr_schedule=constant", "lr_schedule.warmup_steps=2", "optim.lr=1e-3"], 3)
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3], rel=1e-12)


def test_finetune_config_sets_its_own_rate_and_warm_up():
    cfg = compose("finetune", SMALL_DATA)
    assert (cfg.optim.lr, cfg.lr_schedule.warmup_steps, cfg.trainer.max_steps) == (1e-4, 50, 1000)
    assert compose("train", SMALL_DATA).lr_schedule.warmup_steps == 200  # tiny's model.warmup_steps


def test_module_arguments_come_from_the_module_node():
    cfg = compose("train", [*SMALL_DATA, "mask=diagd", "schedule.k=4", "trainer.max_steps=77", "action_loss=true",
                            "model.activation_checkpointing=true"])
    module = build_module(cfg)
    hp = dict(module.hparams)
    assert hp["layout"] == {"h": 3, "w": 4, "n_a": 2} and hp["clip_frames"] == 3
    assert (hp["max_steps"], hp["action_loss"], hp["activation_checkpointing"], hp["model_name"]) == (77, True, True,
                                                                                                      "tiny")
    assert hp["arch"] == {"vocab_size": 32 + 8, "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": None,
                          "mlp_dim": 512}
    assert hp["mask"]["name"] == "diagd" and hp["schedule"]["k"] == 4
    assert hp["lr_schedule"] == {"_target_": "mcar.core.lr_schedule.warmup_cosine", "_partial_": True,
                                 "warmup_steps": 200, "min_lr_ratio": 0.1}
    # plain values only: the checkpoint's hyperparameters rebuild the module (mcar.eval.evaluate.load_model)
    assert all(type(v) in (dict, list, int, float, str, bool, type(None)) for v in hp.values())
    again = MCARModule(**hp)
    assert again.val_diagd_factory.schedule.k == 4 and again.mask_factory.schedule.k == 4


def callbacks_of(overrides: list[str], tmp_path, extra=()) -> list[Callback]:
    cfg = compose("train", [*SMALL_DATA, f"paths.checkpoint_root={tmp_path}/ckpt", "logger=none", *overrides])
    return build_trainer(cfg, str(tmp_path / "out"), list(extra)).callbacks


def configured(callbacks: list[Callback]) -> list[str]:
    names = {Checkpoints: "model_checkpoint", SeenClips: "seen_clips", TQDMProgressBar: "progress_bar"}
    return [names.get(type(c), type(c).__name__) for c in callbacks
            if type(c) in names or type(c).__name__ in ("ValDashboard", "Marker")]


class Marker(Callback):
    pass


def test_every_default_callback_is_instantiated(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    marker = Marker()
    cbs = callbacks_of(["record_seen_clips=true", "checkpoint.every_n_steps=7", "log_every_n_steps=3",
                        "val_dashboard.max_frames=2"], tmp_path, [marker])
    # every one is in the trainer (Lightning moves checkpointing last), the benchmark's added once
    assert sorted(configured(cbs)) == sorted(["model_checkpoint", "ValDashboard", "seen_clips", "progress_bar",
                                              "Marker"])
    by_type = {type(c).__name__: c for c in cbs}
    ckpt = by_type["Checkpoints"]
    assert (ckpt.dirpath, ckpt.filename, ckpt._every_n_train_steps, ckpt.save_top_k, ckpt.save_last) == (
        str(tmp_path / "ckpt" / "train-tiny-synthetic-causal"), "step{step:07d}", 7, -1, True)
    dash = by_type["ValDashboard"]
    assert (dash.sampler_cfg["name"], dash.out, dash.data_name, dash.codebook_size, dash.vq_path, dash.n_clips,
            dash.max_frames, dash.fps, dash.videos) == ("diagd", tmp_path / "out" / "dashboard", "synthetic", 32,
                                                        None, 1, 2, 4, True)
    assert dash.min_steps == 50  # val_dashboard.min_steps: a smoke run samples nothing at its end
    assert by_type["SeenClips"].output_dir == tmp_path / "out"
    assert by_type["TQDMProgressBar"].refresh_rate == 3
    assert cbs.count(marker) == 1


@pytest.mark.parametrize("override,gone", [
    ("checkpoint.every_n_steps=null", "model_checkpoint"), ("val_dashboard.n_clips=0", "ValDashboard"),
    ("record_seen_clips=false", "seen_clips"), ("+trainer.enable_progress_bar=false", "progress_bar"),
    ("callbacks.model_checkpoint=null", "model_checkpoint"), ("callbacks.val_dashboard.enabled=false", "ValDashboard"),
])
def test_a_disabled_callback_is_absent(tmp_path, monkeypatch, override, gone):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    full = ["model_checkpoint", "ValDashboard", "seen_clips", "progress_bar"]
    cbs = callbacks_of(["record_seen_clips=true", override], tmp_path)
    assert sorted(configured(cbs)) == sorted(n for n in full if n != gone)
    if gone == "model_checkpoint":  # Lightning adds no checkpointing of its own either
        assert not any(isinstance(c, ModelCheckpoint) for c in cbs)


def test_callbacks_are_built_in_the_groups_order(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    cfg = compose("train", [*SMALL_DATA, "record_seen_clips=true", "paths.output_dir=/tmp/out"])
    assert configured(build_callbacks(cfg.callbacks)) == ["model_checkpoint", "ValDashboard", "seen_clips",
                                                          "progress_bar"]


def test_the_progress_bar_refreshes_every_log_step_on_a_terminal_too(tmp_path, monkeypatch):
    """Lightning's default rich bar would read the logged metrics after every step: a host sync per step on CUDA."""
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    cbs = callbacks_of(["log_every_n_steps=5"], tmp_path)
    assert "progress_bar" in configured(cbs)
    assert [c.refresh_rate for c in cbs if type(c).__name__ == "TQDMProgressBar"] == [5]
    assert build_callbacks(compose("train", [*SMALL_DATA, "callbacks=none"]).callbacks) == []


def test_a_callback_entry_without_target_is_refused():
    cfg = compose("train", [*SMALL_DATA, "+callbacks.oops.x=1"])
    with pytest.raises(ValueError, match="callbacks.oops: no _target_"):
        build_callbacks(cfg.callbacks)


def test_trainer_precision_follows_the_precision_policy(monkeypatch):
    """conf's `${mcar_precision:}` asks mcar.core.precision: bf16-mixed where CUDA is, 32-true elsewhere."""
    assert compose("train", SMALL_DATA).trainer.precision == "32-true"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compose("train", SMALL_DATA).trainer.precision == "bf16-mixed"


def fake_pretrained(root, run: str, data: str, model: str, dim: int, when: float, stage: str = "train",
                    step: int = 100):
    """A <run>/last.ckpt holding only the hyperparameters and step finetune's default init_from reads, written at
    `when`."""
    import os

    path = root / run / "last.ckpt"
    path.parent.mkdir(parents=True)
    torch.save({"global_step": step, "hyper_parameters": {"data": {"name": data}, "model_name": model, "stage": stage,
                                     "arch": {"vocab_size": 40, "dim": dim, "n_layers": 4, "n_heads": 4,
                                              "n_kv_heads": None, "mlp_dim": 512}}}, path)
    os.utime(path, (when, when))
    return path


def test_finetune_without_init_from_takes_the_most_trained_checkpoint_of_its_data_and_model(tmp_path, caplog):
    import logging
    import time

    from mcar.train.finetune import pick_pretrained, pretrained_checkpoints

    root = tmp_path / "ckpt"
    cfg = compose("finetune", [*SMALL_DATA, f"paths.checkpoint_root={root}"])  # synthetic, tiny (dim 128)
    fake_pretrained(root, "old", "synthetic", "tiny", 128, 1000)
    newest = fake_pretrained(root, "new", "synthetic", "tiny", 128, 2000)
    fake_pretrained(root, "other-data", "crafter", "tiny", 128, 3000)
    fake_pretrained(root, "other-model", "synthetic", "small", 128, 3000)
    fake_pretrained(root, "other-dims", "synthetic", "tiny", 64, 3000)
    fake_pretrained(root, "finetune-x", "synthetic", "tiny", 128, 4000, "finetune")  # never a start ...
    fake_pretrained(root, "mytune", "synthetic", "tiny", 128, 4000, "finetune")  # ... whatever its folder's name
    fake_pretrained(root, "tomorrow", "synthetic", "tiny", 128, time.time() + 86400)  # a clock gone wrong
    (root / "broken").mkdir()
    (root / "broken" / "last.ckpt").write_bytes(b"not a checkpoint")  # named, never a traceback
    outside = fake_pretrained(tmp_path / "elsewhere", "run", "synthetic", "tiny", 128, 5000)
    (root / "linked").mkdir()
    (root / "linked" / "last.ckpt").symlink_to(outside)  # a link out of the checkpoint root is never followed
    assert pick_pretrained(cfg) == newest
    # a short sweep job written after the main run: the main run (more steps) is still the start, and the log
    # names its step and the job passed over
    fake_pretrained(root, "sweep-j0", "synthetic", "tiny", 128, 2500, step=50)
    with caplog.at_level(logging.INFO, logger="mcar"):
        assert pick_pretrained(cfg) == newest
    said = caplog.text
    assert f"init_from: {newest} (step 100), the most trained" in said
    assert "passed over" in said and "sweep-j0/last.ckpt  step 50" in said and "old/last.ckpt  step 100" in said
    for run in ("mytune", "tomorrow", "broken", "linked"):
        assert any(c.path.parent.name == run and c.skip for c in pretrained_checkpoints(root)), run
    # the same second: ambiguous, refused with the candidates, one per line with data, model and time
    fake_pretrained(root, "twin", "synthetic", "tiny", 128, 2000)
    with pytest.raises(ValueError, match=r"both the most trained \(step 100\) and newest pre-trained checkpoint of "
                                         r"data=synthetic model=tiny") as e:
        pick_pretrained(cfg)
    lines = str(e.value).splitlines()[1:]
    assert len(lines) == 12 and all(" data=" in line and " model=" in line for line in lines)
    assert any("other-model/last.ckpt  step 100  data=synthetic model=small (dim 128, 4 layers)" in line
               for line in lines)
    # none of this data and model: refused, listing what there is
    cfg = compose("finetune", [*SMALL_DATA, f"paths.checkpoint_root={root}", "model=small"])
    with pytest.raises(FileNotFoundError, match="no pre-trained checkpoint of data=synthetic model=small"):
        pick_pretrained(cfg)
