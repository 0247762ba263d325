"""The patch VQ (mcar.tokenizer.patch_vq) and the tile-exact Crafter setting it serves (data=crafter_tiles)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mcar.crafter.data import CrafterDataModule
from mcar.crafter.gen import play_episode, write_episode
from mcar.tokenizer.patch_vq import PatchVQ, fit_patch_vq
from mcar.tokenizer.video import read_mp4
from mcar.tokenizer.vq_model import decode_tokens, downsample, encode_tokens, load_vq, to_uint8, vq_id

P = 4  # patch side in these tests


def tiles(n: int, seed: int = 0) -> torch.Tensor:
    """n distinct random P x P x 3 uint8 tiles."""
    return torch.randint(0, 256, (n, P, P, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def scene(tile_set: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """(h, w) tile ids -> an (h P, w P, 3) frame, drawn without any shared code with the VQ."""
    h, w = grid.shape
    out = torch.zeros(h * P, w * P, 3, dtype=torch.uint8)
    for r in range(h):
        for c in range(w):
            out[r * P:(r + 1) * P, c * P:(c + 1) * P] = tile_set[grid[r, c]]
    return out


@pytest.fixture(scope="module")
def fitted():
    tile_set = tiles(12)
    g = torch.Generator().manual_seed(1)
    grids = torch.randint(0, 12, (6, 5, 7), generator=g)
    frames = torch.stack([scene(tile_set, gr) for gr in grids])
    vq, stats = fit_patch_vq(frames, patch=P, codes=16, iters=5)
    return tile_set, vq, stats


def test_fit_gives_every_distinct_patch_its_own_code(fitted):
    tile_set, vq, stats = fitted
    assert stats["distinct"] == 12 and stats["codes_used"] == 12 and stats["mse"] < 1e-10
    assert downsample(vq) == P and vq.config.num_vq_embeddings == 16


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_tokens_of_a_shifted_scene_are_the_shifted_tokens(fitted, data):
    """A token depends on its own patch only: shift the scene by whole patches and the token grid shifts exactly;
    decoding gives the frame back bit for bit."""
    tile_set, vq, _ = fitted
    h, w = data.draw(st.integers(2, 6)), data.draw(st.integers(2, 6))
    grid = torch.tensor(data.draw(st.lists(st.integers(0, 11), min_size=h * w, max_size=h * w))).view(h, w)
    dy, dx = data.draw(st.integers(-1, 1)), data.draw(st.integers(-1, 1))
    frame = scene(tile_set, grid)
    moved = scene(tile_set, torch.roll(grid, (dy, dx), (0, 1)))
    ids, ids_moved = encode_tokens(vq, torch.stack([frame, moved]))
    assert torch.equal(ids_moved, torch.roll(ids, (dy, dx), (0, 1)))
    assert torch.equal(to_uint8(decode_tokens(vq, ids[None]))[0], frame)
    # the same tile is the same token wherever it is
    for t in grid.unique():
        assert ids[grid == t].unique().numel() == 1


def test_save_and_load_round_trip(fitted, tmp_path):
    _, vq, _ = fitted
    vq.save_pretrained(tmp_path / "pvq")
    back = load_vq(tmp_path / "pvq")
    assert isinstance(back, PatchVQ) and downsample(back) == P
    assert torch.equal(back.quantize.embedding.weight, vq.quantize.embedding.weight)
    assert vq_id(tmp_path / "pvq").startswith("pvq@")
    cfg = json.loads((tmp_path / "pvq" / "config.json").read_text())
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**cfg, "num_vq_embeddings": 8}))
    (tmp_path / "bad" / "diffusion_pytorch_model.safetensors").write_bytes(
        (tmp_path / "pvq" / "diffusion_pytorch_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="does not match config.json"):
        load_vq(tmp_path / "bad")


def test_more_distinct_patches_than_codes_uses_every_code():
    frames = tiles(64, seed=3).view(8, 8, P, P, 3).permute(0, 2, 1, 3, 4).reshape(8, P, 8 * P, 3)  # 64 patches
    vq, stats = fit_patch_vq(frames, patch=P, codes=16, iters=10)
    assert stats["distinct"] == 64 and stats["codes_used"] == 16


def test_fixed_patches_get_codes_of_their_own_and_kept_ids_stay():
    """fixed=: every listed patch gets an exact code of its own, seen in the frames or not; keep=: a listed patch
    that was a code of an older VQ keeps its id (its tokens stay valid); patches of the frames that are none of them
    get the codes left over (k-means); the rest are never chosen."""
    tile_set = tiles(12)
    g = torch.Generator().manual_seed(2)
    frames = torch.stack([scene(tile_set[:5], gr) for gr in torch.randint(0, 5, (4, 3, 4), generator=g)])
    old, _ = fit_patch_vq(frames, patch=P, codes=8, iters=3)  # the 5 tiles it saw: codes 0-4 in k-means' order
    vq, stats = fit_patch_vq(frames, patch=P, codes=16, fixed=tile_set, keep=old.quantize.embedding.weight)
    assert (stats["fixed"], stats["kept_ids"], stats["patches_not_fixed"], stats["mse"]) == (12, 5, 0, 0.0)
    ids = encode_tokens(vq, tile_set).view(-1)
    assert ids.unique().numel() == 12 and int(ids.max()) < 12
    assert torch.equal(to_uint8(decode_tokens(vq, ids.view(-1, 1, 1))), tile_set)
    assert torch.equal(ids[:5], encode_tokens(old, tile_set[:5]).view(-1))
    noise = torch.randint(0, 256, (64, P, P, 3), generator=g, dtype=torch.uint8)
    assert int(encode_tokens(vq, noise).max()) < 12  # the 4 codes left over repeat code 0: never the nearest
    again, _ = fit_patch_vq(frames, patch=P, codes=16, fixed=tile_set, keep=vq.quantize.embedding.weight)
    assert torch.equal(again.quantize.embedding.weight, vq.quantize.embedding.weight)  # rebuilding changes nothing
    extra = tiles(3, seed=9)  # in the frames but not listed: k-means gives them the codes left over
    more = torch.cat([frames, torch.stack([scene(extra, torch.randint(0, 3, (3, 4), generator=g))])])
    vq2, stats2 = fit_patch_vq(more, patch=P, codes=16, fixed=tile_set, iters=5)
    assert stats2["patches_not_fixed"] == 12 and stats2["mse"] < 1e-10
    both = torch.cat([tile_set, extra])
    assert encode_tokens(vq2, both).unique().numel() == 15
    assert torch.equal(to_uint8(decode_tokens(vq2, encode_tokens(vq2, both).view(-1, 1, 1))), both)
    with pytest.raises(ValueError, match="do not fit codes=8"):
        fit_patch_vq(frames, patch=P, codes=8, fixed=tile_set)
    with pytest.raises(ValueError, match="same pixels"):
        fit_patch_vq(frames, patch=P, codes=16, fixed=torch.cat([tile_set, tile_set[:1]]))


def test_the_committed_tile_vq_is_exact_on_tile_crafter():
    """The committed vq_crafter_tiles on a fresh episode of data=crafter_tiles (seed 7, not a training seed):
    every 16x16 tile decodes to its own pixels, and the tile under a moving player's old neighbour is the same
    token one column/row over in the next frame."""
    vq = load_vq(Path(__file__).parents[1] / "mcar" / "assets" / "vq_crafter_tiles")
    frames, records = play_episode(7, 0, 40, {"random": 1.0}, (224, 384), (24, 14), daylight=1.0)
    frames = torch.from_numpy(frames)
    ids = encode_tokens(vq, frames)
    rec = to_uint8(decode_tokens(vq, ids))
    assert (rec == frames).float().mean() > 0.999
    kept = total = 0
    for t in range(1, len(records) - 1):  # frame t was seen before action t; records[t - 1]['pos'] is where it was
        (x0, y0), (x1, y1) = records[t - 1]["pos"], records[t]["pos"]
        dx, dy = x1 - x0, y1 - y0
        if (dx, dy) == (0, 0):
            continue
        a, b = ids[t, :13], ids[t + 1, :13]  # the map rows
        same = b[1:12, 1:23] == a[1 + dy:12 + dy, 1 + dx:23 + dx]
        kept, total = kept + int(same.sum()), total + same.numel()
    assert total > 0 and kept / total > 0.97, kept / total


def test_pinned_daylight_and_lossless_video(tmp_path):
    """data.daylight pins Crafter's light level (every record says so); data.lossless writes video that reads back
    bit for bit; both name the episode folder."""
    frames, records = play_episode(2, 0, 6, {"explorer": 1.0}, (224, 384), (24, 14), daylight=1.0)
    assert {r["daylight"] for r in records} == {1.0}
    write_episode(tmp_path, 2, 0, 6, {"explorer": 1.0}, (224, 384), (24, 14), daylight=1.0, lossless=True)
    video, err = read_mp4(tmp_path / "crafter_s2_e00000.mp4")
    assert err is None and np.array_equal(video, frames)
    kw = dict(root=str(tmp_path), episodes=3, frames_per_episode=24, gen_seed=0, workers=1, h=14, w=24, n_a=1,
              codebook_size=16, action_vocab_size=17, clip_frames=4, batch_size=2, seed=0, val_clips=2,
              val_episodes=1)
    dm = CrafterDataModule(**kw, view=[24, 14], daylight=1, lossless=True)
    assert dm.set_dir.name == "seed0_24f_explorer75_random25_view24x14_daylight1_lossless"
    with pytest.raises(ValueError, match="data.daylight=1.5"):
        CrafterDataModule(**kw, daylight=1.5)


def test_crafter_tiles_config_uses_the_committed_patch_vq():
    from tests.conftest import compose

    cfg = compose("train", ["data=crafter_tiles"])
    assert Path(cfg.vq.path) == Path(__file__).parents[1] / "mcar" / "assets" / "vq_crafter_tiles"
    assert cfg.data.codebook_size == load_vq(cfg.vq.path).config.num_vq_embeddings == 128
    every = compose("train", ["data=crafter_tiles", "vq=tiles_all"])  # every tile its own code (test_tile_vq.py)
    assert every.data.codebook_size == load_vq(every.vq.path).config.num_vq_embeddings == 256
    assert list(cfg.data.view) == [24, 14] and cfg.data.daylight == 1.0 and cfg.data.lossless
    # its own name (own IDM, own run names) but Crafter's actions: named in the IDM's table, mcar.play and generate
    from mcar.idm.scores import action_names
    from mcar.sampling.prompts import parse_action

    assert action_names(cfg.data, 17)[1] == "move_left" == action_names(compose("train").data, 17)[1]
    assert parse_action("move_left", "crafter", 1) == [1]
