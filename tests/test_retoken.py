"""finetune.py retoken=true: a model trained on one patch VQ starts a model of another's tokens (code_map,
retoken_state), checked against the shipped model on the committed VQs."""
from pathlib import Path

import numpy as np
import pytest
import torch

from mcar.checkpoint.load import load_model
from mcar.core.model import ModelConfig, Transformer
from mcar.data.index import build_index
from mcar.tokenizer.clips import join_clip
from mcar.tokenizer.patch_vq import PatchVQ, code_map, patch_vectors
from mcar.tokenizer.vq_model import decode_tokens, encode_tokens, load_vq, to_uint8
from mcar.train.finetune import retoken_state
from tests.conftest import REPO, job_overrides, run_in_process

SHIPPED = REPO / "checkpoints" / "shipped" / "crafter_world"
ASSETS = REPO / "mcar" / "assets"


def patch_vq(tiles: torch.Tensor) -> PatchVQ:
    vq = PatchVQ(tiles.shape[1], len(tiles))
    vq.quantize.embedding.weight.data.copy_(patch_vectors(tiles))
    return vq


def test_code_map_follows_pixels_and_marks_new_textures_and_pads():
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 256, (5, 4, 4, 3), generator=g, dtype=torch.uint8)
    near = t[2].clone()
    near[0, 0, 0] ^= 1  # one grey level off tile 2: a new texture whose nearest old code is 2
    src = patch_vq(torch.stack([t[0], t[1], t[2], t[3], t[0]]))  # code 4 pads with code 0's pixels
    dst = patch_vq(torch.stack([t[3], t[0], near, t[1], t[0], t[4]]))  # code 4 pads too; t[4] is new
    codes, exact = code_map(src, dst)
    assert codes[:5].tolist() == [3, 0, 2, 1, 0]  # the first of equals, as tokenising picks it
    assert exact.tolist() == [True, True, False, True, False, False]
    with pytest.raises(ValueError, match="the dst VQ is a Linear; only patch VQs"):
        code_map(src, torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="patches of 4 px x 3 channels against 2"):
        code_map(src, patch_vq(torch.randint(0, 256, (3, 2, 2, 3), dtype=torch.uint8)))


def retokenised(src, dst, ids: torch.Tensor) -> torch.Tensor:
    """Token ids of `src` -> the ids `dst` gives the same pixels (decoded, then tokenised again)."""
    return encode_tokens(dst, to_uint8(decode_tokens(src, ids)))


@pytest.fixture(scope="module")
def shipped_clip():
    """The shipped model, and one of its held-out clips in the tokens of vq=tiles and of vq=tiles_all (decoded to
    pixels and tokenised again: the tokeniser's own path, not code_map)."""
    sm, hp = load_model(SHIPPED / "last.ckpt")
    frames = torch.from_numpy(np.load(SHIPPED / "held_out" / "crafter_s0_e00094.frames.npy")[:6].astype(np.int64))
    actions = torch.from_numpy(np.load(SHIPPED / "held_out" / "crafter_s0_e00094.actions.npy")[:6].astype(np.int64))
    tiles, tiles_all = load_vq(ASSETS / "vq_crafter_tiles"), load_vq(ASSETS / "vq_crafter_tiles_all")
    again = retokenised(tiles, tiles_all, frames)
    return sm, hp, tiles, tiles_all, frames, again, actions


def test_retokened_model_predicts_as_the_old_one_on_the_same_tiles(shipped_clip):
    """Same pixels in, same logits out: every code with its pixels in both VQs keeps the old logit, a new texture
    starts at the mean of the old image logits, the action ids keep theirs."""
    sm, hp, tiles, tiles_all, frames, again, actions = shipped_clip
    old_cb, new_cb = 128, 256
    codes, exact = code_map(tiles, tiles_all)
    assert torch.equal(codes[again], frames)  # tile for tile (tiles_all kept tiles' ids; the action ids move up 128)
    state = {f"model.{k}": v for k, v in sm.model.state_dict().items()}
    new = Transformer(ModelConfig(**dict(hp["arch"], vocab_size=new_cb + 17)))
    new.load_state_dict({k[len("model."):]: v for k, v in retoken_state(state, codes, exact, old_cb, new_cb).items()})
    coords = sm.layout.coords(6)
    with torch.no_grad():
        before = sm.model(join_clip(frames, actions, old_cb)[None], coords)[0]
        after = new.eval()(join_clip(again, actions, new_cb)[None], coords)[0]
    torch.testing.assert_close(after[:, :new_cb][:, exact], before[:, codes[exact]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after[:, new_cb:], before[:, old_cb:], atol=1e-5, rtol=1e-5)
    mean = before[:, :old_cb].mean(1, keepdim=True).expand(-1, int((~exact).sum()))
    torch.testing.assert_close(after[:, :new_cb][:, ~exact], mean, atol=1e-4, rtol=1e-5)
    assert int(exact.sum()) == 83


def test_finetune_retoken_starts_a_model_of_the_new_vq(tmp_path, shipped_clip, capsys):
    """finetune.py retoken=true from the shipped vq=tiles model onto tiles_all tokens trains and saves a model of
    the new vocabulary; without retoken=true, or onto its own VQ, it is refused naming the fix."""
    from mcar.tools.finetune import main as finetune

    *_, tiles, tiles_all, frames, again, _ = shipped_clip
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    for name in ("crafter_s0_e00094", "crafter_s0_e00095"):  # the held-out episodes, in tiles_all tokens
        f = torch.from_numpy(np.load(SHIPPED / "held_out" / f"{name}.frames.npy")[:24].astype(np.int64))
        np.save(tokens / f"{name}.frames.npy", retokenised(tiles, tiles_all, f).numpy()
                .astype(np.uint16))
        np.save(tokens / f"{name}.actions.npy", np.load(SHIPPED / "held_out" / f"{name}.actions.npy")[:24])
    build_index(tokens, {"codebook_size": 256, "n_a": 1, "action_vocab_size": 17})
    data = ["data=tokens", f"data.tokens_dir={tokens}", "data.h=9", "data.w=9", "data.n_a=1", "data.actions=crafter",
            "data.action_vocab_size=17", "data.clip_frames=6", "data.val_episodes=1", "data.val_clips=2",
            "data.batch_size=2", f"init_from={SHIPPED / 'last.ckpt'}", "steps=1", "logger=none",
            "val_dashboard.n_clips=0", "trainer.val_check_interval=1", "checkpoint.every_n_steps=1"]
    with pytest.raises(ValueError, match="but data.vocab_size=273; to start from it on another patch VQ, add "
                                         "retoken=true"):
        run_in_process(finetune, *data, "vq=tiles_all", *job_overrides(tmp_path, "a"))
    with pytest.raises(ValueError, match="retoken=true: this run's VQ is .* own"):
        run_in_process(finetune, *data, "vq=tiles", "retoken=true", *job_overrides(tmp_path, "b"))
    run_in_process(finetune, *data, "vq=tiles_all", "retoken=true", "run_name=rt", *job_overrides(tmp_path, "c"))
    assert "retoken: 83 of 256 codes" in capsys.readouterr().out
    ckpt = torch.load(tmp_path / "ckpt" / "rt" / "last.ckpt", weights_only=False)
    assert ckpt["hyper_parameters"]["arch"]["vocab_size"] == 273
    assert Path(ckpt["hyper_parameters"]["vq"]["path"]).name == "vq_crafter_tiles_all"
    assert ckpt["state_dict"]["model.output.weight"].shape[0] == 273
