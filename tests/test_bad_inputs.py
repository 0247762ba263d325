"""Inputs that used to fail deep inside torch or diffusers now fail naming the file or the field."""
import json
import logging
import shutil
import subprocess
import sys

import pytest
import torch

from mcar.core.layout import Layout
from tests.conftest import REPO, SMALL_DATA, compose

SMALL_VQ = REPO / "mcar" / "assets" / "vq_crafter_small"


@pytest.mark.parametrize("key", ["n_clips", "batch_size"])
def test_evaluate_refuses_zero_clips_or_batch(tmp_path, key):
    from mcar.eval.evaluate import evaluate

    cfg = compose("evaluate", [*SMALL_DATA, "ckpt=unused.ckpt", f"{key}=0", f"paths.output_dir={tmp_path}"])
    with pytest.raises(ValueError, match=f"{key}=0: evaluate needs at least 1"):
        evaluate(cfg)


def test_a_vq_folder_of_another_shape_is_named(tmp_path):
    from mcar.tokenizer.vq_model import load_vq

    shutil.copytree(SMALL_VQ, tmp_path / "vq")
    cfg = json.loads((tmp_path / "vq" / "config.json").read_text())
    (tmp_path / "vq" / "config.json").write_text(json.dumps(cfg | {"num_vq_embeddings": 8192}))
    with pytest.raises(ValueError, match=f"cannot load the VQ at {tmp_path / 'vq'}"):
        load_vq(tmp_path / "vq")


def test_a_malformed_vq_config_is_named(tmp_path):
    from mcar.tokenizer.vq_model import load_vq

    shutil.copytree(SMALL_VQ, tmp_path / "vq")
    (tmp_path / "vq" / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match=f"{tmp_path / 'vq' / 'config.json'} is not a VQ config"):
        load_vq(tmp_path / "vq")


def test_convert_names_a_ckpt_without_layers(tmp_path):
    from mcar.tools.convert import convert_mineworld

    torch.save({"state_dict": {"model.embed_tokens.weight": torch.zeros(4, 2)}}, tmp_path / "x.ckpt")
    with pytest.raises(ValueError, match="LLaMA weights without model.layers.0.mlp.gate_proj.weight"):
        convert_mineworld(tmp_path / "x.ckpt", tmp_path / "out", heads=1)


def test_a_checkpoint_with_separate_gate_and_up_weights_is_named_in_one_line():
    """Feed_forward.w1 / w3 (gate / up apart) against the fused w13: one line naming the tensor and the fix."""
    from mcar.checkpoint.io import check_state_shapes
    from mcar.core.model import ModelConfig, Transformer

    model = Transformer(ModelConfig(vocab_size=8, dim=16, n_layers=1, n_heads=2, mlp_dim=32))
    state = model.state_dict()
    state["layers.0.feed_forward.w1.weight"], state["layers.0.feed_forward.w3.weight"] = \
        state.pop("layers.0.feed_forward.w13.weight").chunk(2)
    with pytest.raises(ValueError, match=r"^checkpoint old\.ckpt: layers\.0\.feed_forward\.w1\.weight: separate gate "
                                         r"\(w1\) and up \(w3\) .* concatenate [^\n]*re-save$"):
        check_state_shapes(model, state, "old.ckpt")

def test_sampling_past_the_trained_length_is_said(caplog):
    from mcar.checkpoint.load import warn_past_trained_length

    with caplog.at_level(logging.WARNING, logger="mcar"):
        warn_past_trained_length(3, {"clip_frames": 3})
        assert not caplog.records
        warn_past_trained_length(40, {"clip_frames": 3})
    assert "frames=40 runs past the 3 frames this model was trained on" in caplog.text


@pytest.mark.parametrize("argv, said", [
    (["soak", "kills=abc"], "Error: kills=abc: kills takes a number, not 'abc'"),
    (["crafter_gen", "out=/proc/nope/x", "episodes=1", "size=[64,64]"],
     "Error: out=/proc/nope/x: No such file or directory (/proc/nope)"),
])
def test_a_value_the_command_line_gave_is_named_when_it_fails(argv, said):
    """A number that is not one, or a path the OS refuses: one line naming key=value (once a bare int() or
    mkdir message, or a traceback)."""
    from tests.conftest import script_env

    env = {k: v for k, v in script_env().items() if k != "HYDRA_FULL_ERROR"}
    p = subprocess.run([sys.executable, "-m", "mcar.cli", *argv], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1 and p.stderr.strip().splitlines()[0] == said, p.stderr[-2000:]


def test_a_prompt_image_that_is_no_image_is_named(tmp_path):
    from omegaconf import OmegaConf

    from mcar.core.layout import Layout
    from mcar.sampling.prompts import image_clip
    from tests.test_data_vpt import tiny_vq

    (tmp_path / "notes.png").write_text("not a picture")
    cfg = OmegaConf.create({"prompt_image": str(tmp_path / "notes.png"), "actions": [0], "data": {"name": "x"}})
    with pytest.raises(ValueError, match=r"prompt_image=.*notes.png: not an image this can read"):
        image_clip(cfg, Layout(2, 3, 1), tiny_vq())


def test_an_unknown_prompt_episode_is_refused_before_any_data_is_built(tmp_path):
    from mcar.sampling.prompts import episode_clip

    cfg = compose("generate", ["ckpt=x", "data=crafter", f"paths.data_dir={tmp_path}/data", "held_out=data"])
    with pytest.raises(ValueError, match="prompt=nosuch: data=crafter has no such episode; episodes: crafter_s0_e0"):
        episode_clip(cfg, "nosuch", 0, 3, Layout.of(cfg.data))
    assert not (tmp_path / "data").exists()
