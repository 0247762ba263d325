"""What makes a checkpoint start with no data to build: its held-out clips shipped beside it (`held_out=auto`),
its IDM found by name (`idm=auto`), its VQ path relocated into this install, its data config inside it."""

import pytest
import torch
from omegaconf import OmegaConf

from mcar.core.layout import Layout

from .conftest import REPO, compose
from .test_data_integrity import shards

SHIPPED = REPO / "checkpoints" / "shipped" / "crafter_tiles_diagd"


def token_module(folder):
    from mcar.data.token_clips import TokenDataModule

    class Folder(TokenDataModule):
        tokens_dir = folder

    return Folder(h=3, w=4, n_a=2, codebook_size=32, action_vocab_size=8, clip_frames=3, batch_size=2,
                  val_episodes=2)


def small_data(**kw):
    return OmegaConf.create({"h": 3, "w": 4, "n_a": 2, "codebook_size": 32, "action_vocab_size": 8, **kw})


def test_exported_held_out_clips_are_the_datas_validation_clips(tmp_path):
    from mcar.idm.model import tokens_name
    from mcar.sampling.held_out import ShippedHeldOut, export_held_out

    src = tmp_path / "tokens_vq_x_123"
    shards(src, {"a": 7, "b": 9, "c": 10, "d": 6})
    dm = token_module(src)
    out = export_held_out(dm, tmp_path / "run" / "held_out")
    assert sorted(p.name for p in out.glob("*.npy")) == ["c.actions.npy", "c.frames.npy", "d.actions.npy",
                                                         "d.frames.npy"]  # the last 2 episodes: validation
    shipped = ShippedHeldOut(out, small_data(), 3)
    assert len(shipped.val_source) == len(dm.val_source) == 3 + 2  # non-overlapping 3-frame clips: 10 // 3 + 6 // 3
    for i in range(len(dm.val_source)):
        assert torch.equal(shipped.val_source.clip(i), dm.val_source.clip(i))
    assert tokens_name(shipped) == tokens_name(dm) == "tokens_vq_x_123"  # an IDM trained on the data fits
    with pytest.raises(ValueError, match="data.h, data.w, data.n_a = 3, 5, 2"):  # held against the data config
        ShippedHeldOut(out, small_data(w=5), 3)


def test_held_out_auto_finds_the_checkpoints_folder_else_the_data(tmp_path):
    from mcar.sampling.held_out import held_out_folder

    run = tmp_path / "run"
    run.mkdir()
    (run / "last.ckpt").write_bytes(b"")
    cfg = lambda value: OmegaConf.create({"ckpt": str(run), "held_out": value})  # noqa: E731
    assert held_out_folder(cfg("auto")) is None  # nothing shipped: the data's validation episodes
    shards(run / "held_out", {"e": 4})
    assert held_out_folder(cfg("auto")) == run / "held_out"
    assert held_out_folder(cfg("data")) is None
    assert held_out_folder(cfg(str(run / "held_out"))) == run / "held_out"
    with pytest.raises(FileNotFoundError, match="held_out=.*nowhere: no index.json"):
        held_out_folder(cfg(str(tmp_path / "nowhere")))


def test_idm_auto_prefers_your_own_then_the_shipped_one(tmp_path):
    from mcar.eval.action_following import resolve_idm

    assert resolve_idm("auto", tmp_path, "crafter_tiles") == str(tmp_path / "idm-crafter_tiles" / "idm.pt")
    shipped = tmp_path / "shipped" / "idm-crafter_tiles" / "idm.pt"
    shipped.parent.mkdir(parents=True)
    shipped.write_bytes(b"")
    assert resolve_idm("auto", tmp_path, "crafter_tiles") == str(shipped)
    own = tmp_path / "idm-crafter_tiles" / "idm.pt"
    own.parent.mkdir(parents=True)
    own.write_bytes(b"")
    assert resolve_idm("auto", tmp_path, "crafter_tiles") == str(own)
    assert resolve_idm("/x/idm.pt", tmp_path, "crafter_tiles") == "/x/idm.pt"
    assert resolve_idm(None, tmp_path, "a") is None
    assert resolve_idm("auto", REPO / "checkpoints", "crafter_tiles") == \
        str(REPO / "checkpoints" / "shipped" / "idm-crafter_tiles" / "idm.pt") or \
        (REPO / "checkpoints" / "idm-crafter_tiles" / "idm.pt").exists()


def test_a_checkpoints_asset_paths_are_relocated_into_this_install():
    from mcar.assets import asset_path, relocated_asset
    from mcar.checkpoint.config import relocate_assets

    here = asset_path("vq_crafter_tiles")
    assert relocated_asset("/some/other/clone/mcar/assets/vq_crafter_tiles") == here
    assert relocated_asset(here) == here and relocated_asset("./data/crafter") == "./data/crafter"
    assert relocated_asset("/else/mcar/assets/no_such_asset") == "/else/mcar/assets/no_such_asset"
    assert relocated_asset(3) == 3
    node = {"vq_path": "/x/mcar/assets/vq_crafter_tiles", "view": [24, 14], "root": "./data/crafter"}
    assert relocate_assets(node) == {"vq_path": here, "view": [24, 14], "root": "./data/crafter"}


@pytest.mark.skipif(not (SHIPPED / "last.ckpt").exists(), reason="the shipped checkpoint is not in this checkout")
def test_the_shipped_checkpoint_carries_its_data_and_fits_its_held_out_clips():
    from mcar.checkpoint.load import check_data_fits, load_model
    from mcar.sampling.held_out import held_out_data

    module, hp = load_model(SHIPPED)
    assert hp["data"]["name"] == "crafter_tiles" and hp["vq"]["name"] == "tiles"
    data = OmegaConf.create(hp["data"])
    check_data_fits(module.layout, hp, data)
    wider = Layout(module.layout.h, module.layout.w + 1, module.layout.n_a)  # the model's layout is the one checked
    with pytest.raises(ValueError, match="does not fit the checkpoint's"):
        check_data_fits(wider, hp, data)
    cfg = OmegaConf.create({"ckpt": str(SHIPPED), "held_out": "auto", "data": hp["data"]})
    source = held_out_data(cfg, 3).val_source
    assert len(source) == 2 * (128 // 3) and source.folder == SHIPPED / "held_out"
    assert compose("evaluate", []).held_out == "auto" and compose("evaluate", []).idm == "auto"


def test_an_asset_another_clone_holds_on_this_machine_is_still_this_installs(tmp_path):
    """A checkpoint trained in another checkout names that checkout's VQ; when that folder exists on this machine
    too, the loading install's own asset is still the one used (not the other clone's files)."""
    from mcar.assets import asset_path
    from mcar.checkpoint.config import relocate_assets

    other = tmp_path / "other_clone" / "mcar" / "assets" / "vq_crafter_tiles"
    other.mkdir(parents=True)
    (other / "config.json").write_text("{}")
    assert relocate_assets({"vq": {"path": str(other)}}) == {"vq": {"path": asset_path("vq_crafter_tiles")}}
    assert relocate_assets({"path": "mcar/assets/vq_crafter_tiles"}) == {"path": asset_path("vq_crafter_tiles")}


def test_a_checkpoint_records_its_assets_by_name_not_this_checkouts_path():
    """What a checkpoint stores names a committed asset as mcar/assets/<name>: no machine's checkout in it."""
    from mcar.assets import asset_path
    from mcar.train.module import MCARModule

    vq = asset_path("vq_crafter_tiles")
    module = MCARModule(arch=dict(vocab_size=40, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, mlp_dim=32),
                        layout=dict(h=2, w=2, n_a=1), clip_frames=2, mask={"name": "causal"}, optim={}, max_steps=1,
                        vq={"name": "tiles", "path": vq}, data={"name": "crafter", "vq_path": vq, "root": "./data"})
    checkpoint = {"hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)
    hp = checkpoint["hyper_parameters"]
    assert hp["vq"]["path"] == hp["data"]["vq_path"] == "mcar/assets/vq_crafter_tiles"
    assert hp["data"]["root"] == "./data" and hp["arch"]["dim"] == 16
