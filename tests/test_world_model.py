"""Mcar.sampling.WorldModel: one loaded checkpoint every sampling tool shares, and its one window default."""
import pytest
import torch

from .conftest import SMALL_DATA, compose
from .test_cached_attention import tiny_checkpoint


@pytest.mark.parametrize("tool", ["generate", "evaluate", "play", "worldtest"])
def test_every_sampling_tool_rolls_past_the_same_window(tmp_path, tool):
    """The window is sampler.context (null: the checkpoint's clip_frames) for every tool: a clip longer than it
    rolls a KV cache of the last `context` frames (evaluate sampled one window at untrained positions before)."""
    from mcar.sampling.world_model import WorldModel

    ckpt = tiny_checkpoint(tmp_path)  # clip_frames 3
    wm = WorldModel.from_config(compose(tool, [*SMALL_DATA, f"ckpt={ckpt}"]))
    assert wm.context == wm.trained_frames == 3
    long, short = wm.sampler(8), wm.sampler(3)
    assert long.rolls() and long.context == 3 and not short.rolls()
    assert wm.sampler(8, context=2).context == 2 and wm.sampler(8, temperature=0.0).temperature == 0.0
    assert wm.sampler(8, schedule={"k": 1}).config.k == 1 and wm.sampler(8).config.k == 2  # per call, not kept
    narrow = WorldModel.from_config(compose(tool, [*SMALL_DATA, f"ckpt={ckpt}", "sampler.context=2"]))
    assert narrow.context == 2 and narrow.sampler(8).context == 2
    with pytest.raises(ValueError, match="sampler.context=1"):
        WorldModel.from_config(compose(tool, [*SMALL_DATA, f"ckpt={ckpt}", "sampler.context=1"]))


def test_generate_batches_and_scores_teacher_forced_on_cpu_tensors(tmp_path):
    from mcar.sampling.world_model import WorldModel

    wm = WorldModel.from_config(compose("evaluate", [*SMALL_DATA, f"ckpt={tiny_checkpoint(tmp_path)}",
                                                     "sampler.seed=0"]))
    clips = torch.randint(0, 32, (3, wm.layout.n_slots(5)))
    sampler = wm.sampler(5)
    whole, stats = wm.generate(clips, sampler)
    split, split_stats = wm.generate(clips, sampler, batch_size=2)
    assert torch.equal(whole[:2], split[:2])  # noise keyed by (seed, batch row, slot): the first batch's rows agree
    assert whole.shape == clips.shape and whole.device.type == "cpu"
    assert stats.tokens == split_stats.tokens == 3 * 4 * 12 and wm.model.kv_caches() is None  # cache released
    per_clip = wm.teacher_forced_loss(clips, sampler)
    assert per_clip.shape == (len(clips),)
    assert torch.allclose(per_clip, wm.teacher_forced_loss(clips, sampler, 1))


def test_a_long_video_is_decoded_and_written_a_chunk_at_a_time(tmp_path, monkeypatch):
    """Generate frames=N: the side-by-side video is decoded `chunk` frames at a time while the mp4 is written (its
    memory does not grow with N); the gif keeps the first GIF_FRAMES frames, the mp4 every one."""
    from mcar.core.layout import Layout
    from mcar.tokenizer import pictures
    from mcar.tokenizer.video import read_mp4

    from .test_data_vpt import tiny_vq

    layout, T = Layout(2, 3, 1), 40
    clip = torch.randint(0, 16, (T * layout.frame_len,))
    clip.view(T, -1)[:, -1] = 16  # the action slots: action 0
    widest, decode = [], pictures.decode_frames
    monkeypatch.setattr(pictures, "decode_frames", lambda vq, ids: widest.append(ids.shape[1]) or decode(vq, ids))
    monkeypatch.setattr(pictures, "GIF_FRAMES", 8)
    frames = pictures.comparison_stream({"a": clip, "b": clip}, layout, 16, tiny_vq(), None, chunk=16)
    mp4, gif = pictures.write_video(frames, tmp_path / "long", fps=4)
    assert max(widest) == 16 and len(widest) == 2 * 3  # two columns, three chunks of at most 16 frames
    assert len(read_mp4(mp4)[0]) == T
    from PIL import Image

    assert Image.open(gif).n_frames == 8


def test_what_a_checkpoint_asks_for_is_checked_against_this_machine(tmp_path):
    """A checkpoint's clip length asking for a KV cache larger than the machine, and a data config
    asking a sampling tool to build 100,000 episodes, are each refused in one line before any allocation or build."""
    from mcar.sampling.held_out import held_out_data
    from mcar.sampling.world_model import WorldModel

    ckpt = tiny_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"a window of 100000000 frames x 14 slots needs a .* GiB KV cache"):
        WorldModel.from_config(compose("generate", [*SMALL_DATA, f"ckpt={ckpt}", "sampler.context=100000000"]))
    cfg = compose("generate", ["ckpt=x", "data=crafter", "data.episodes=100000", f"paths.data_dir={tmp_path}/d",
                               "held_out=data"])
    with pytest.raises(ValueError, match="data.episodes=100000: reading held-out clips would build 100000"):
        held_out_data(cfg, 3)
    assert not (tmp_path / "d").exists()


def data_carrying_checkpoint(tmp_path):
    """tiny_checkpoint's model with the data config it was trained on, as train.py saves it."""
    from omegaconf import OmegaConf

    path = tiny_checkpoint(tmp_path)
    state = torch.load(path, weights_only=True)
    state["hyper_parameters"]["data"] = OmegaConf.to_container(compose("train", SMALL_DATA).data, resolve=True)
    torch.save(state, path)
    return path


def test_plain_python_load_takes_the_checkpoints_config_and_dotted_overrides(tmp_path):
    """WorldModel.load(path) needs no Hydra config: the checkpoint's data is adopted, device and dtype are auto,
    and overrides are the dotted keys a sampling tool takes (a mapping is flattened); a bad key is one line."""
    from mcar import WorldModel

    path = data_carrying_checkpoint(tmp_path)
    wm = WorldModel.load(path)
    assert (wm.cfg.data.h, wm.cfg.data.w, wm.cfg.data.n_a) == (3, 4, 2) and wm.device.type == "cpu"
    assert next(wm.model.parameters()).dtype == torch.float32 and wm.context == 3
    tuned = WorldModel.load(path, **{"sampler.context": 2}, sampler={"temperature": 0.0}, schedule={"k": 1})
    assert tuned.context == 2 and tuned.sampler(5).temperature == 0.0 and tuned.sampler(5).config.k == 1
    clips = wm.held_out_clips(frames=3, n_clips=2)
    assert clips.shape == (2, wm.layout.n_slots(3))
    with pytest.raises(ValueError) as e:
        WorldModel.load(path, **{"sampler.no_such_key": 1})
    assert "no_such_key" in str(e.value) and "\n" not in str(e.value)


def test_the_readme_python_snippet_runs_on_the_shipped_model(tmp_path, monkeypatch):
    """The README's Python API block, run as written from a folder holding the repository's checkpoints/: it
    loads the shipped model, generates from a held-out clip and writes the GIF it names."""
    import re

    from PIL import Image

    from .conftest import REPO

    block = re.search(r"<!-- python-api:begin -->\s*```python\n(.*?)```\s*<!-- python-api:end -->",
                      (REPO / "README.md").read_text(), re.S)
    assert block, "README.md has no python-api block between its markers"
    (tmp_path / "checkpoints").symlink_to(REPO / "checkpoints")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    exec(compile(block.group(1), "README.md python-api", "exec"), {})
    gif = Image.open(tmp_path / "outputs" / "python_api.gif")
    assert gif.n_frames == 8 and gif.size[0] > 0
