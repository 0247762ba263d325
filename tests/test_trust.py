"""No file a user may get from elsewhere runs code. Each loader is fed a torch.save'd object whose
unpickling would create a marker file (as `os.system` would run anything): every one refuses it, naming the file,
and no marker appears. Genuine files (the shipped model and IDM) still load. `run_name` cannot leave the checkpoint
root."""
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, SMALL_DATA, compose, job_overrides, run_script


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
    from mcar.checkpoint.load import load_model

    path = hostile("run/last.ckpt")
    assert str(path) in refused(lambda: load_model(path.parent, "cpu"), hostile)


def test_init_from_of_finetune_is_refused(hostile, tmp_path):
    from mcar.train.finetune import prepare_finetune

    path = hostile("pre/last.ckpt")
    cfg = compose("finetune", [*SMALL_DATA, f"init_from={path}", f"paths.checkpoint_root={tmp_path}/ckpt"])
    refused(lambda: prepare_finetune(cfg), hostile)


def test_ckpt_path_of_train_is_refused_by_us_and_by_lightnings_resume(hostile, tmp_path):
    from mcar.checkpoint.io import AtomicCheckpointIO
    from mcar.train.task import run

    path = hostile("ckpt/x/last.ckpt")
    cfg = compose("train", [*SMALL_DATA, "model=tiny", "logger=none", f"ckpt_path={path}",
                            f"paths.checkpoint_root={tmp_path}/ckpt", f"paths.output_dir={tmp_path}/out"])
    refused(lambda: run(cfg), hostile)
    refused(lambda: AtomicCheckpointIO().load_checkpoint(path, weights_only=False), hostile)


def sharded_checkpoint(folder: Path) -> Path:
    """A genuine sharded checkpoint folder as trainer=fsdp writes it: torch.distributed.checkpoint's shards and
    .metadata, Lightning's meta.pt beside them."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": {"w": torch.randn(3, 2)}, "step": torch.tensor(2)}, checkpoint_id=folder)
    torch.save({"global_step": 2, "epoch": 0}, folder / "meta.pt")
    return folder


def test_a_sharded_ckpt_path_is_read_as_data_before_torch_unpickles_its_metadata(hostile, tmp_path):
    """Torch.distributed.checkpoint reads a sharded folder's .metadata with plain pickle: train's resume refuses a
    .metadata (or meta.pt) holding code before Lightning gets the folder; a genuine one passes."""
    import pickle

    from mcar.checkpoint.io import check_sharded_checkpoint
    from mcar.train.task import run

    check_sharded_checkpoint(sharded_checkpoint(tmp_path / "genuine"))
    folder = sharded_checkpoint(tmp_path / "ckpt" / "x" / "last.ckpt")
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(hostile.marker)))
    cfg = compose("train", [*SMALL_DATA, "model=tiny", "logger=none", f"ckpt_path={folder}",
                            f"paths.checkpoint_root={tmp_path}/ckpt", f"paths.output_dir={tmp_path}/out"])
    assert "posix.system" in refused(lambda: run(cfg), hostile)
    meta = sharded_checkpoint(tmp_path / "meta")
    hostile("meta/meta.pt")
    refused(lambda: check_sharded_checkpoint(meta), hostile)


def test_idm_of_evaluate_is_refused(hostile):
    from mcar.eval.action_following import load_idm

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
    """Diffusers reads a VQ's .bin weights with weights_only=True (pinned here: load_vq relies on it)."""
    from mcar.tokenizer.vq_model import load_vq

    folder = tmp_path / "vq"
    folder.mkdir()
    shutil.copy(REPO / "mcar" / "assets" / "vq_crafter_small" / "config.json", folder / "config.json")
    hostile("vq/diffusion_pytorch_model.bin", wrap=lambda p: {"x": p})
    with pytest.raises(ValueError, match=f"cannot load the VQ at {folder}"):
        load_vq(folder)
    assert not hostile.marker.exists(), "the payload ran"


def test_genuine_files_load_as_weights_only():
    from mcar.checkpoint.io import load_checkpoint
    from mcar.eval.action_following import load_idm

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



# ------------------------------------------------------------------------ a checkpoint's config is data, never code
def tiny_checkpoint(path: Path, edit=lambda hp: None) -> Path:
    """A genuine tiny checkpoint of `train data=synthetic` (its hyper-parameters as train.py saves them), `edit`ed
    in place (a hostile sender's changes), saved as plain dicts: the weights-only load accepts it."""
    from mcar.hydra_app import to_dict
    from mcar.train.module import MCARModule

    hp = {k: v for k, v in to_dict(compose("train", [*SMALL_DATA, "model=tiny"]).module).items() if k != "_target_"}
    state = MCARModule(**hp).state_dict()
    edit(hp)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"hyper_parameters": hp, "state_dict": state, "global_step": 0}, path)
    return path


def test_an_arch_that_does_not_fit_the_weights_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    """A 1 kB edit of arch made mcar allocate 51 GB before comparing it with the weights."""
    import mcar.checkpoint.load as load

    path = tiny_checkpoint(tmp_path / "big.ckpt", lambda hp: hp["arch"].update(dim=8192, n_layers=64, mlp_dim=32768))
    real = load.Transformer

    def on_meta_only(cfg):
        assert torch.empty(0).device.type == "meta", "a model was built before the check"
        return real(cfg)

    monkeypatch.setattr(load, "Transformer", on_meta_only)
    with pytest.raises(ValueError, match=rf"(?s)checkpoint {path} does not fit this model .*model.tok_embeddings"):
        load.load_model(path)


def writes_file(marker: Path) -> dict:
    """The auditor's data config: Hydra's instantiate, asked to build a node whose _target_ writes `marker`."""
    return {"_target_": "hydra.utils.instantiate",
            "config": {"_target_": "builtins.dict",
                       "x": {"_target_": "pathlib.Path.write_text",
                             "_args_": [{"_target_": "pathlib.Path", "_args_": [str(marker)]}, "echo pwned\n"]}}}


# the tools that adopt a checkpoint's config, as the CLI runs them: in a Hydra app (only there is it adopted)
TOOLS = {"evaluate": ("-m mcar.cli evaluate", "ckpt=", ["logger=none"]),
         "generate": ("-m mcar.cli generate", "ckpt=", ["prompt=0"]),
         "finetune": ("finetune.py", "init_from=", ["logger=none", "steps=1"])}


def run_tool(tool: str, ckpt: Path, tmp_path: Path):
    script, key, extra = TOOLS[tool]
    return run_script(script, f"{key}{ckpt}", *job_overrides(tmp_path, tool), *extra, check=False)


@pytest.mark.parametrize("tool", list(TOOLS))
def test_a_checkpoints_data_config_naming_code_is_refused(tool, tmp_path):
    """A checkpoint that passes the weights-only load made mcar call what its stored data config named
    (build_datamodule instantiates it). Its `_target_` keys must be those of mcar/conf/data/<its name>.yaml: the
    refusal names the checkpoint and the field, and nothing runs."""
    marker = tmp_path / "PWNED"
    ckpt = tiny_checkpoint(tmp_path / "run" / "last.ckpt", lambda hp: hp["data"].update(writes_file(marker)))
    p = run_tool(tool, ckpt, tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "refused the checkpoint's data._target_='hydra.utils.instantiate'" in out, out[-3000:]
    assert str(ckpt) in out and "mcar/conf/data/synthetic.yaml" in out
    assert not marker.exists(), "the checkpoint's data config ran code"


def test_an_interpolation_in_a_checkpoints_config_is_refused_unresolved(tmp_path, monkeypatch):
    """`${oc.env:...}` stored in a checkpoint would read this machine's environment (a secret, then shown in an
    error message or logged): refused, and the value never read."""
    monkeypatch.setenv("MCAR_TEST_SECRET", "s3cr3t-token")
    ckpt = tiny_checkpoint(tmp_path / "run" / "last.ckpt",
                           lambda hp: hp["data"].update(seed="${oc.env:MCAR_TEST_SECRET}"))
    p = run_tool("generate", ckpt, tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "refused the checkpoint's data.seed='${oc.env:MCAR_TEST_SECRET}'" in out, \
        out[-3000:]
    assert "s3cr3t-token" not in out


def test_a_genuine_checkpoint_still_brings_its_config(tmp_path):
    """The other side: a genuine checkpoint's data, VQ and schedule are adopted as before (no data= repeated)."""
    ckpt = tiny_checkpoint(tmp_path / "run" / "last.ckpt")
    p = run_tool("generate", ckpt, tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "data and schedule as the checkpoint was trained" in p.stdout + p.stderr


def test_the_shipped_checkpoints_config_passes_unchanged():
    from mcar.checkpoint.config import checkpoint_group_config
    from mcar.checkpoint.io import load_checkpoint

    hp = load_checkpoint(REPO / "checkpoints" / "shipped" / "crafter_tiles_diagd" / "last.ckpt")["hyper_parameters"]
    vq = str(REPO / "mcar" / "assets" / "vq_crafter_tiles")  # this install's, whatever checkout trained it
    assert checkpoint_group_config("vq", hp["vq"], "ckpt=shipped") == hp["vq"] | {"path": vq}
    assert checkpoint_group_config("schedule", hp["schedule"], "ckpt=shipped") == hp["schedule"]
    data = checkpoint_group_config("data", hp["data"], "ckpt=shipped")
    assert data | {"root": None} == hp["data"] | {"root": None, "vq_path": vq}
    assert data["root"] == "${paths.data_dir}/crafter"  # this install's (the shipped file says ./data/crafter)


def test_a_checkpoint_never_decides_where_data_is_built_or_how_its_vq_trains():
    """data.root and data.vq_train_overrides come from this install's config of the same name (a checkpoint
    chose where generate built data, and its override strings reached the VQ job's compose())."""
    from mcar.checkpoint.config import checkpoint_group_config
    from mcar.checkpoint.io import load_checkpoint

    hp = load_checkpoint(REPO / "checkpoints" / "shipped" / "crafter_tiles_diagd" / "last.ckpt")["hyper_parameters"]
    hostile = hp["data"] | {"root": "/etc/elsewhere", "vq_train": True,
                            "vq_train_overrides": ["out=/root/x", "episodes=1000000", "+hydra.searchpath=[/tmp]"]}
    data = checkpoint_group_config("data", hostile, "ckpt=x")
    assert data["root"] == "${paths.data_dir}/crafter" and data["vq_train_overrides"] == []


@pytest.mark.parametrize("where", ["vq_trainer", "nested", "unknown_group", "args", "schedule"])
def test_code_keys_a_checkpoint_adds_anywhere_are_refused(where):
    """Nested `_target_` / `_args_` nodes (a vq_trainer mcar's crafter config no longer has, a policy), a data
    config whose name no packaged group has, and groups without code (schedule): each refused by field."""
    from mcar.checkpoint.config import checkpoint_group_config
    from mcar.checkpoint.io import load_checkpoint

    hp = load_checkpoint(REPO / "checkpoints" / "shipped" / "crafter_tiles_diagd" / "last.ckpt")["hyper_parameters"]
    group, node, field = {
        "vq_trainer": ("data", hp["data"] | {"vq_trainer": {"_target_": "os.system", "_partial_": True}},
                       "data.vq_trainer._target_"),
        "nested": ("data", hp["data"] | {"policy_mix": {"explorer": {"_target_": "os.getcwd"}}},
                   "data.policy_mix.explorer._target_"),
        "unknown_group": ("data", hp["data"] | {"name": "mine"}, "data._target_"),
        "args": ("data", hp["data"] | {"_args_": ["x"]}, "data._args_"),
        "schedule": ("schedule", hp["schedule"] | {"_target_": "os.getcwd"}, "schedule._target_")}[where]
    with pytest.raises(ValueError, match=rf"ckpt=/x/last.ckpt: refused the checkpoint's {re.escape(field)}"):
        checkpoint_group_config(group, node, "ckpt=/x/last.ckpt")


# ----------------------------------------------------------------------------------- vq_train ckpt_path=<file>
TINY_VQ_TRAIN = ["crop=[64,64]", "batch_size=2", "steps=1", "kmeans_init=false", "vq.arch.norm_num_groups=4",
                 "vq.arch.block_out_channels=[8,8,8,8,8]", "vq.arch.latent_channels=4", "vq.arch.num_vq_embeddings=16",
                 "vq.arch.vq_embed_dim=4"]


def test_ckpt_path_of_vq_train_is_read_as_weights_only(hostile, tmp_path, monkeypatch):
    """`vq_train ckpt_path=<file>` goes to Lightning's resume: read by our weights-only loader, whatever torch's
    default (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 makes Lightning's own loader unpickle anything)."""
    from mcar.train import vq_training

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    frames = torch.randint(0, 255, (4, 64, 64, 3), dtype=torch.uint8)
    monkeypatch.setattr(vq_training, "make_data", lambda cfg: (frames, frames[:2]))
    path = hostile("vq/last.ckpt")
    cfg = compose("vq_train", [*TINY_VQ_TRAIN, f"out={tmp_path}/out", f"ckpt_path={path}"])
    assert str(path) in refused(lambda: vq_training.train(cfg), hostile)


def test_vq_train_betas_come_from_its_config():
    from mcar.train.vq_training import VQLit

    for overrides, betas in (([], (0.9, 0.99)), (["betas=[0.5,0.9]"], (0.5, 0.9))):
        lit = VQLit(compose("vq_train", [*TINY_VQ_TRAIN, *overrides]))
        assert lit.configure_optimizers()["optimizer"].param_groups[0]["betas"] == betas


# ------------------------------------------------------------------------------------------ the sweep's table
def test_the_sweeps_table_is_never_left_half_written(tmp_path, monkeypatch):
    """A job killed (or a disk filling) while it rewrites <sweep>/results.csv must not lose the other jobs' rows."""
    from mcar.eval import reporting

    sweep = tmp_path / "sweep"
    reporting.merge_rows(sweep, [{"model": "a", "sampler": "ntp", "psnr": 20.0}])
    before = {f: (sweep / f).read_text() for f in ("results.csv", "results.md")}

    def dies_midway(v):
        if v == 21.0:
            raise KeyboardInterrupt("killed")
        return v

    monkeypatch.setattr(reporting, "_csv_cell", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        reporting.merge_rows(sweep, [{"model": "b", "sampler": "ntp", "psnr": 21.0}])
    assert {f: (sweep / f).read_text() for f in before} == before
    assert sorted(p.name for p in sweep.iterdir()) == ["results.csv", "results.md"]  # no temp file left


def test_command_line_overrides_on_an_adopted_checkpoint_config_parse_as_hydra_parses_them():
    """Finetune init_from=... data.recall={max_actions:5,...}: a mapping on the command line reached the adopted
    data config as the keys 'max_actions:5' (a YAML dotlist), and the data refused them."""
    from omegaconf import OmegaConf

    from mcar.checkpoint.config import apply_overrides

    cfg = OmegaConf.create({"data": {"n_a": 2, "recall": {"legs": 3, "mix": {"back": 1.0}}, "view": [24, 14]}})
    apply_overrides(cfg, ["data.recall={max_actions:5,mix:{wait:0.5},legs:2}", "data.n_a=1", "data.view=[9,9]",
                          "+data.seed=4"])
    assert OmegaConf.to_container(cfg.data) == {
        "n_a": 1, "recall": {"legs": 2, "mix": {"back": 1.0, "wait": 0.5}, "max_actions": 5}, "view": [9, 9], "seed": 4}
