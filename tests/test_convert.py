"""`mcar convert mineworld`: a random, reduced LLaMA checkpoint with MineWorld's config shape (GQA, 1D RoPE, untied
head, image codes then action ids) is converted and compared on the same clip with what transformers computed on it
(tests/fixtures/llama_reference.pt, written by scripts/llama_reference.py: see tests/llama_reference.py)."""
import json

import pytest
import torch

from mcar.core.masks import CausalMask
from mcar.core.sampler import ScheduleSampler
from mcar.tools.convert import convert_mineworld, main
from tests.llama_reference import (
    CODES,
    FRAMES,
    GEOMETRY_FRAMES,
    GEOMETRY_LAYOUT,
    GEOMETRY_ROWS,
    LAYOUT,
    clip,
    geometry_config,
    mlp_input,
    reference,
    tiny_config,
    write_llama,
)

HF = "hf"  # the folder a test writes its random LLaMA checkpoint to


def tiny_llama(tmp_path, tie=False):
    """The Hugging Face folder of a random LLaMA with MineWorld's config shape; its config dict."""
    config = tiny_config(tie)
    write_llama(tmp_path / HF, config)
    return config


def converted(tmp_path, tie=False):
    tiny_llama(tmp_path, tie)
    path = convert_mineworld(tmp_path / HF, tmp_path / "out", h=3, w=4, n_a=2)
    from mcar.checkpoint.load import load_model  # the loader mcar.generate and mcar.evaluate use

    return path, load_model(path, "cpu")


@pytest.mark.parametrize("tie", [False, True])
def test_converted_logits_equal_transformers(tmp_path, tie):
    path, (module, hp) = converted(tmp_path, tie)
    model, x = module.model.eval(), clip()
    assert hp["arch"]["rope"] == "1d" and hp["arch"]["n_kv_heads"] == 2 and hp["clip_frames"] == FRAMES
    want = reference()[f"tiny_logits_tie_{tie}"]
    with torch.no_grad():
        batch = CausalMask(LAYOUT, FRAMES)(x)
        got = model(batch.tokens, batch.coords, batch.mask)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err
    assert want.abs().max() > 1  # logits that say something (not all ~0)


def test_gate_and_up_are_fused_into_w13_as_llama_computes_its_mlp(tmp_path):
    """w13 = [gate_proj; up_proj]: each converted FeedForward equals transformers' LlamaMLP on the same input (a
    swapped or interleaved layout gives silu(up) * gate: far off)."""
    from safetensors.torch import load_file

    from mcar.core.model import FeedForward
    from mcar.tools.convert import model_config, to_mcar

    config = tiny_llama(tmp_path)
    llama = load_file(str(tmp_path / HF / "model.safetensors"))  # model.layers.<i>.mlp.gate_proj.weight, ...
    cfg, _ = model_config(llama, config, None, None)
    weights = to_mcar(llama, cfg)
    x, want = mlp_input(cfg.dim), reference()["tiny_mlp"]
    for i in range(config["num_hidden_layers"]):
        ffn = FeedForward(cfg)
        ffn.load_state_dict({k.removeprefix(f"layers.{i}.feed_forward."): v for k, v in weights.items()
                             if k.startswith(f"layers.{i}.feed_forward.")})
        with torch.no_grad():
            torch.testing.assert_close(ffn(x), want[i], rtol=1e-6, atol=1e-6)


def test_ntp_and_diagd_k_equal_w_sample_the_same_tokens(tmp_path):
    """On the converted model, DiagD with k = w (no proxies, one image token per pass) is NTP: same tokens,
    greedy and seeded."""
    _, (module, _) = converted(tmp_path)
    model = module.model.eval()
    for rule in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        ntp = ScheduleSampler.ntp(LAYOUT, FRAMES, 1, codebook_size=CODES, **rule)
        diag = ScheduleSampler(LAYOUT, FRAMES, 1, k=LAYOUT.w, d=None, codebook_size=CODES, **rule)
        (a, sa), (b, sb) = ntp.generate(model, clip()), diag.generate(model, clip())
        assert torch.equal(a, b) and sa.passes == sb.passes
        assert not torch.equal(a, clip())  # it generated something


def test_mineworld_ckpt_wrapper_and_cli(tmp_path, capsys):
    """MineWorld's own .ckpt: {"state_dict": {"transformer.<llama keys>", "tokenizer.<VQ keys>"}}, no config.json:
    the shape comes from heads=; the VQ keys are left out."""
    from safetensors.torch import load_file

    tiny_llama(tmp_path)
    state = {f"transformer.{k}": v for k, v in load_file(str(tmp_path / HF / "model.safetensors")).items()}
    state["tokenizer.model.quantize.embedding.weight"] = torch.zeros(4, 2)
    torch.save({"state_dict": state}, tmp_path / "mineworld.ckpt")
    main(["format=mineworld", f"src={tmp_path / 'mineworld.ckpt'}", f"out={tmp_path / 'cli'}", "heads=8",
          f"frames={FRAMES}",
          "h=3", "w=4", "n_a=2"])
    path = capsys.readouterr().out.strip().splitlines()[-1]
    ckpt = torch.load(path, weights_only=False)
    assert ckpt["hyper_parameters"]["arch"]["n_heads"] == 8 and ckpt["hyper_parameters"]["arch"]["n_kv_heads"] == 2
    assert not any("tokenizer" in k for k in ckpt["state_dict"])
    with pytest.raises(ValueError, match="heads="):  # no config.json, no model=, no heads=: says what to pass
        convert_mineworld(tmp_path / "mineworld.ckpt", tmp_path / "x", frames=FRAMES, h=3, w=4, n_a=2)


def test_unsupported_configs_are_refused(tmp_path):
    tiny_llama(tmp_path)
    cfg_path = tmp_path / HF / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for scaled in ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                   {"rope_parameters": {"rope_theta": 1000.0, "rope_type": "yarn", "factor": 2.0}}):
        cfg_path.write_text(json.dumps(cfg | scaled))
        with pytest.raises(ValueError, match="rope_scaling"):
            convert_mineworld(tmp_path / HF, tmp_path / "out", h=3, w=4, n_a=2)
    cfg_path.write_text(json.dumps(cfg | {"num_attention_heads": 4}))
    with pytest.raises(ValueError, match="head_dim=8 is not hidden_size / num_attention_heads = 16"):
        convert_mineworld(tmp_path / HF, tmp_path / "out", h=3, w=4, n_a=2)
    cfg_path.write_text(json.dumps(cfg | {"num_attention_heads": 4, "head_dim": None}))
    with pytest.raises(ValueError, match="k_proj.weight has shape"):
        convert_mineworld(tmp_path / HF, tmp_path / "out", h=3, w=4, n_a=2)
    assert not (tmp_path / "out" / "last.ckpt").exists()  # nothing written for a refused conversion


def test_data_mineworld_has_the_mineworld_vocabulary():
    """data=mineworld vq=amused composes to MineWorld's 8,262-token vocabulary and a model=mineworld_700m of its
    shape (GQA 32/4, 1D RoPE): the converted checkpoint fits it; the data module checks its action ids."""
    from hydra.utils import instantiate

    from tests.conftest import compose

    cfg = compose("generate", ["data=mineworld", "data.root=/nonexistent", "vq=amused", "ckpt=x"])
    assert cfg.data.vocab_size == 8262 and cfg.data.actions == "mineworld" and cfg.data.n_a == 11
    train = compose("train", ["data=mineworld", "data.root=/nonexistent", "vq=amused", "model=mineworld_700m"])
    arch = train.model.arch
    assert (arch.dim, arch.n_heads, arch.n_kv_heads, arch.mlp_dim, arch.rope, arch.vocab_size) == \
        (2048, 32, 4, 4096, "1d", 8262)
    with pytest.raises(Exception, match="data.action_vocab_size=71 but data.actions=mineworld has 70"):
        instantiate(train.data, action_vocab_size=71, _recursive_=False)


@pytest.mark.slow
def test_converted_checkpoint_finetunes_with_the_diagd_mask_and_generates(tmp_path):
    """The converted checkpoint is a starting point like any other: finetune.py init_from= (mask=diagd, the
    prompt proxy) adopts its 1D-RoPE GQA config and trains; mcar.generate samples it with DiagD."""
    from mcar.tools.generate import generate
    from tests.conftest import SMALL_DATA, compose, job_overrides, run_script

    tiny_llama(tmp_path)
    path = convert_mineworld(tmp_path / HF, tmp_path / "conv", h=3, w=4, n_a=2)
    run_script("finetune.py", *SMALL_DATA, "mask=diagd", "schedule.proxy=prompt", "steps=2", f"init_from={path}",
               "run_name=ft-mineworld", "logger=none", "val_dashboard.n_clips=0", *job_overrides(tmp_path))
    tuned = torch.load(tmp_path / "ckpt" / "ft-mineworld" / "last.ckpt", weights_only=False)
    hp = tuned["hyper_parameters"]
    assert hp["arch"]["rope"] == "1d" and hp["arch"]["n_kv_heads"] == 2 and hp["schedule"]["proxy"] == "prompt"
    assert tuned["global_step"] == 2
    cfg = compose("generate", [*SMALL_DATA, f"ckpt={path}", "sampler=diagd", "schedule.proxy=prompt", "prompt=1",
                               f"frames={FRAMES}", f"paths.output_dir={tmp_path / 'gen'}"])
    res = generate(cfg)
    assert res["passes"] == (FRAMES - 2) * 8 + 8  # DiagD k=2 on 3x4 frames: s_spa = 2*2 + 4


def test_1d_rope_tables_equal_transformers_at_mineworld_head_dim():
    """head_dim 64 (every MineWorld size) over 5,552 slots (16 frames of 347): our inverse frequencies equal LLaMA's
    bit for bit (float32; float64-then-rounded ones differed in 10 of 32 and drifted the logits), and so do the
    tables up to the last slot (the drift grows with the position: ~3e-4 at the end)."""
    from mcar.core.rope import RoPE1D

    ref, slots = reference(), GEOMETRY_LAYOUT.n_slots(GEOMETRY_FRAMES)
    ours = RoPE1D(64, 10000.0)
    coords = torch.zeros(1, slots, 4, dtype=torch.long)
    coords[..., 3] = torch.arange(slots)
    cos, sin = ours(coords)
    assert torch.equal(ours.inv_freq, ref["rope_inv_freq"])
    torch.testing.assert_close(cos[0, ::16], ref["rope_cos"], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0, ::16], ref["rope_sin"], rtol=0, atol=1e-6)


def test_a_ckpt_that_records_its_length_converts_at_that_length(tmp_path):
    """A MineWorld .ckpt keeps its transformer config in its hyper-parameters: a 32-frame one used to convert at the
    preset's 16 frames unless frames= was given."""
    from safetensors.torch import load_file

    tiny_llama(tmp_path)
    state = {f"transformer.{k}": v for k, v in load_file(str(tmp_path / HF / "model.safetensors")).items()}
    frame_len = LAYOUT.frame_len
    torch.save({"state_dict": state, "hyper_parameters": {"model": {"config": {"max_position_embeddings":
                                                                                4 * frame_len}}}},
               tmp_path / "long.ckpt")
    path = convert_mineworld(tmp_path / "long.ckpt", tmp_path / "out", heads=8, h=3, w=4, n_a=2)
    assert torch.load(path, weights_only=True)["hyper_parameters"]["clip_frames"] == 4


def test_converted_logits_equal_transformers_at_mineworld_geometry(tmp_path):
    """A one-layer LLaMA with MineWorld's head_dim (64) and geometry (16 frames of 14 x 24 + 11 = 5,552 slots): the
    converted model's logits equal transformers' to float32 round-off at every kept slot, the last ones included
    (float64 RoPE frequencies drifted them ~1e-4)."""
    path = convert_mineworld(write_llama(tmp_path / HF, geometry_config()), tmp_path / "out", h=14, w=24, n_a=11,
                             frames=GEOMETRY_FRAMES)
    from mcar.checkpoint.load import load_model

    model = load_model(path, "cpu")[0].model.eval()
    x = clip(GEOMETRY_LAYOUT, GEOMETRY_FRAMES, batch=1)
    with torch.no_grad():
        batch = CausalMask(GEOMETRY_LAYOUT, GEOMETRY_FRAMES)(x)
        got = model(batch.tokens, batch.coords, batch.mask)[0, GEOMETRY_ROWS]
    want = reference()["geometry_logits"]
    err = (got - want).abs().amax(-1) / want.abs().max()
    assert (err < 2e-6).all(), (err > 2e-6).nonzero()[:5].flatten().tolist()


def test_convert_refusals_end_the_command_with_one_line(tmp_path, capsys):
    """`mcar convert` composes its config itself, outside Hydra's runner: its refusals printed a full traceback."""
    from mcar.cli import main as mcar

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "last.ckpt").write_bytes(b"a trained run")
    with pytest.raises(SystemExit) as stop:
        mcar(["convert", "format=mineworld", f"src={tmp_path / 'nowhere'}", f"out={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "Traceback" not in err
    assert err.splitlines()[0].startswith(f"Error: out={tmp_path / 'run'} already holds checkpoints (last.ckpt)")
