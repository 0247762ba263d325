"""Issue 3/5 item 1: no file a user may get from elsewhere runs code. Each loader is fed a torch.save'd object whose
unpickling would create a marker file (as `os.system` would run anything): every one refuses it, naming the file,
and no marker appears. Genuine files (the shipped model and IDM) still load. `run_name` cannot leave the checkpoint
root."""
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, SMALL_DATA, compose


class Payload:
    """Unpickling this calls os.system: it would touch `marker` (on today's main, in every loader)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def hostile(tmp_path):
    """-> make(name, wrap) writing torch.save(wrap(Payload)) to tmp_path/name; the marker path."""
    marker = tmp_path / "PWNED"

    def make(name: str, wrap=lambda p: {"state_dict": {"w": torch.zeros(1)}, "extra": p}) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(wrap(Payload(marker)), path)
        return path

    make.marker = marker
    return make


def refused(fn, hostile):
    with pytest.raises(ValueError, match=r"refused to load .*(Unsupported global|more than tensors)") as e:
        fn()
    assert not hostile.marker.exists(), "the payload ran"
    return str(e.value)


def test_ckpt_of_generate_evaluate_play_is_refused(hostile):
    from mcar.eval.checkpoint import load_model

    path = hostile("run/last.ckpt")
    assert str(path) in refused(lambda: load_model(path.parent, "cpu"), hostile)


def test_init_from_of_finetune_is_refused(hostile, tmp_path):
    from mcar.train.finetune import prepare_finetune

    path = hostile("pre/last.ckpt")
    cfg = compose("finetune", [*SMALL_DATA, f"init_from={path}", f"paths.checkpoint_root={tmp_path}/ckpt"])
    refused(lambda: prepare_finetune(cfg), hostile)


def test_ckpt_path_of_train_is_refused_by_us_and_by_lightnings_resume(hostile, tmp_path):
    from mcar.train.checkpoint_io import AtomicCheckpointIO
    from mcar.train.task import run

    path = hostile("ckpt/x/last.ckpt")
    cfg = compose("train", [*SMALL_DATA, "model=tiny", "logger=none", f"ckpt_path={path}",
                            f"paths.checkpoint_root={tmp_path}/ckpt", f"paths.output_dir={tmp_path}/out"])
    refused(lambda: run(cfg), hostile)
    refused(lambda: AtomicCheckpointIO().load_checkpoint(path, weights_only=False), hostile)


def test_idm_of_evaluate_is_refused(hostile):
    from mcar.eval.idm import load_idm

    path = hostile("idm.pt", wrap=lambda p: {"config": {}, "state_dict": {"codebook": torch.zeros(2)}, "meta": p})
    refused(lambda: load_idm(str(path)), hostile)


@pytest.mark.parametrize("name", ["mineworld.ckpt", "weights.pt", "pytorch_model.bin"])
def test_convert_reads_ckpt_pt_and_bin_as_weights_only(hostile, name):
    from mcar.tools.convert import read_weights

    path = hostile(name, wrap=lambda p: {"state_dict": {"model.embed_tokens.weight": torch.zeros(2, 2), "x": p}})
    refused(lambda: read_weights(path), hostile)


def test_soak_reads_its_checkpoints_as_weights_only(hostile):
    from mcar.tools.soak import final_state

    refused(lambda: final_state(hostile("last.ckpt")), hostile)


def test_a_vq_folder_with_pickled_code_is_refused(hostile, tmp_path):
    """diffusers reads a VQ's .bin weights with weights_only=True (pinned here: load_vq relies on it)."""
    from mcar.tokenizer.vq_model import load_vq

    folder = tmp_path / "vq"
    folder.mkdir()
    shutil.copy(REPO / "mcar" / "assets" / "vq_crafter_small" / "config.json", folder / "config.json")
    hostile("vq/diffusion_pytorch_model.bin", wrap=lambda p: {"x": p})
    with pytest.raises(ValueError, match=f"cannot load the VQ at {folder}"):
        load_vq(folder)
    assert not hostile.marker.exists(), "the payload ran"


def test_genuine_files_load_as_weights_only():
    from mcar.eval.idm import load_idm
    from mcar.train.checkpoint_io import load_checkpoint

    shipped = REPO / "checkpoints" / "shipped"
    assert "state_dict" in load_checkpoint(shipped / "crafter_tiles_diagd" / "last.ckpt")
    assert load_idm(str(shipped / "idm-crafter_tiles" / "idm.pt")).meta is not None


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", "/abs", ".hidden", "", "a\\b"])
def test_run_name_must_be_a_plain_name(name, tmp_path):
    from mcar.train.jobs import check_run_name
    from mcar.train.task import run

    with pytest.raises(ValueError, match="run_name="):
        check_run_name(name)
    cfg = compose("train", [*SMALL_DATA, "model=tiny", "logger=none", f"paths.checkpoint_root={tmp_path}/a/b/ckpt",
                            f"paths.output_dir={tmp_path}/out", f"run_name='{name}'"])
    with pytest.raises(ValueError, match="run_name="):
        run(cfg)
    assert not any(tmp_path.rglob("*.ckpt")) and not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["train-tiny-synthetic-causal", "table3-ft-diagd_k2", "a.b=c,d+e", "x-j3"])
def test_plain_run_names_pass(name):
    from mcar.train.jobs import check_run_name

    assert check_run_name(name) == name
