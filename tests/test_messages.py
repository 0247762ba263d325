"""What a user sees when a run is refused: one line naming the file or field, and no run folder left behind."""
import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO


def test_a_modules_own_error_is_said_plainly_not_inside_hydras_instantiate_error(capsys):
    """finetune and posttrain build their module through Hydra's instantiate, which wraps the module's own error
    in a 5-line InstantiationException: the command says the module's line."""
    import hydra

    from mcar.hydra_app import said_plainly

    arch = dict(vocab_size=40, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, mlp_dim=32)
    node = {"_target_": "mcar.train.module.MCARModule", "arch": arch, "layout": dict(h=2, w=2, n_a=1),
            "clip_frames": 2, "mask": {"name": "causal"}, "optim": {}, "max_steps": 1, "residual_dtype": "abc"}
    job = said_plainly(lambda cfg: hydra.utils.instantiate(node, _recursive_=False))
    with pytest.raises(SystemExit):
        job(None)
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "Error: residual_dtype='abc': one of ['bfloat16', 'float32'] (conf/train.yaml)", err
    assert "Error in call to target" not in err


def test_init_from_takes_a_run_folder_as_ckpt_does(tmp_path):
    from mcar.checkpoint.load import resolve_ckpt

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(FileNotFoundError, match=r"^init_from: checkpoint not found: .*run/last.ckpt$"):
        resolve_ckpt(str(run), "init_from")
    (run / "last.ckpt").write_bytes(b"x")
    assert resolve_ckpt(str(run), "init_from") == run / "last.ckpt"


def test_a_mapping_override_naming_a_key_the_mapping_lacks_lists_its_keys():
    from mcar.hydra_app import compose_tool

    with pytest.raises(SystemExit) as e:
        compose_tool("posttrain", ["starts.policy_mix={nope:1}"])
    assert str(e.value) == ("mcar posttrain: starts.policy_mix={nope:1}: starts.policy_mix has the keys explorer, "
                            "random, wanderer; set those (starts.policy_mix.explorer=...), or add a key with "
                            "+starts.policy_mix.<name>=...")


def test_a_refused_sampling_run_leaves_no_run_folder(tmp_path, monkeypatch, capsys):
    """`mcar generate ckpt=<missing>` fails in the job, after Hydra made outputs/generate/<time>/ with .hydra/ and
    a log: the folder, and outputs/ it made, go, and no log handler is left writing into it (the next log line of
    this process would reopen the log there and fail)."""
    import logging

    from mcar.tools.generate import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit):
        main([f"ckpt={tmp_path / 'missing.ckpt'}"])
    assert "checkpoint not found" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    files = [h.baseFilename for lg in loggers for h in getattr(lg, "handlers", []) if hasattr(h, "baseFilename")]
    assert not [f for f in files if str(tmp_path) in f]


def test_a_safetensors_file_that_is_not_one_is_named(tmp_path):
    from mcar.tokenizer.patch_vq import WEIGHTS, PatchVQ

    shutil.copytree(REPO / "mcar" / "assets" / "vq_crafter_tiles", tmp_path / "vq")
    if not (tmp_path / "vq" / WEIGHTS).is_file():
        pytest.skip("the tiles VQ is not a patch VQ here")
    (tmp_path / "vq" / WEIGHTS).write_bytes(b"not safetensors at all")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'vq' / WEIGHTS} is not a patch VQ's safetensors file"):
        PatchVQ.from_pretrained(tmp_path / "vq")
    assert json.loads((tmp_path / "vq" / "config.json").read_text())


def test_the_shipped_run_folder_is_a_valid_init_from():
    from mcar.checkpoint.load import resolve_ckpt

    run = REPO / "checkpoints" / "shipped" / "crafter_world"
    if not run.is_dir():
        pytest.skip("the shipped checkpoint is not in this checkout")
    assert resolve_ckpt(str(run), "init_from") == Path(run) / "last.ckpt"
