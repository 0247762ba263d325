"""`mcar convert mineworld`: a randomly initialised, reduced LlamaForCausalLM with MineWorld's config
shape (GQA, 1D RoPE, untied head, image codes then action ids) is saved, converted and compared on the same clip."""
import json

import pytest
import torch

from mcar.core.layout import Layout
from mcar.core.masks import CausalMask
from mcar.core.sampler import ScheduleSampler
from mcar.tools.convert import convert_mineworld, main

transformers = pytest.importorskip("transformers",
                                   reason="the parity test needs transformers: pip install -e '.[convert]'")

LAYOUT, FRAMES, CODES = Layout(3, 4, 2), 3, 32  # 14 slots per frame: 12 image tokens then 2 actions


def tiny_llama(tmp_path, tie=False):
    cfg = transformers.LlamaConfig(
        vocab_size=CODES + 8, hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2,
        num_hidden_layers=2, max_position_embeddings=LAYOUT.n_slots(FRAMES), rope_theta=1000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, initializer_range=0.2, attention_bias=False, mlp_bias=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a swapped norm weight shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "hf")
    return hf


def clip(batch=2):
    g = torch.Generator().manual_seed(1)
    c = torch.randint(0, CODES, (batch, LAYOUT.n_slots(FRAMES)), generator=g)
    act = ~LAYOUT.is_image(FRAMES)
    c[:, act] = CODES + torch.randint(0, 6, (batch, int(act.sum())), generator=g)
    return c


def converted(tmp_path, tie=False):
    hf = tiny_llama(tmp_path, tie)
    path = convert_mineworld(tmp_path / "hf", tmp_path / "out", h=3, w=4, n_a=2)
    from mcar.checkpoint.load import load_model  # the loader mcar.generate and mcar.evaluate use

    return hf, path, load_model(path, "cpu")


@pytest.mark.parametrize("tie", [False, True])
def test_converted_logits_equal_transformers(tmp_path, tie):
    hf, path, (module, hp) = converted(tmp_path, tie)
    model, x = module.model.eval(), clip()
    assert hp["arch"]["rope"] == "1d" and hp["arch"]["n_kv_heads"] == 2 and hp["clip_frames"] == FRAMES
    with torch.no_grad():
        want = hf(input_ids=x, position_ids=torch.arange(x.shape[1])[None].expand_as(x)).logits
        batch = CausalMask(LAYOUT, FRAMES)(x)
        got = model(batch.tokens, batch.coords, batch.mask)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, err
    assert want.abs().max() > 1  # logits that say something (not all ~0)


def test_gate_and_up_are_fused_into_w13_as_llama_computes_its_mlp(tmp_path):
    """w13 = [gate_proj; up_proj]: each converted FeedForward equals transformers' LlamaMLP on the same input (a
    swapped or interleaved layout gives silu(up) * gate: far off)."""
    from mcar.core.model import FeedForward
    from mcar.tools.convert import model_config, to_mcar

    hf = tiny_llama(tmp_path)
    llama = hf.state_dict()  # the keys LlamaForCausalLM saves: model.layers.<i>.mlp.gate_proj.weight, ...
    cfg, _ = model_config(llama, hf.config.to_dict(), None, None)
    weights = to_mcar(llama, cfg)
    x = torch.randn(3, 5, cfg.dim, generator=torch.Generator().manual_seed(2))
    for i, layer in enumerate(hf.model.layers):
        ffn = FeedForward(cfg)
        ffn.load_state_dict({k.removeprefix(f"layers.{i}.feed_forward."): v for k, v in weights.items()
                             if k.startswith(f"layers.{i}.feed_forward.")})
        with torch.no_grad():
            want, got = layer.mlp(x), ffn(x)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

def test_ntp_and_diagd_k_equal_w_sample_the_same_tokens(tmp_path):
    """On the converted model, DiagD with k = w (no proxies, one image token per pass) is NTP: same tokens,
    greedy and seeded."""
    _, _, (module, _) = converted(tmp_path)
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
    hf = tiny_llama(tmp_path)
    state = {f"transformer.{k}": v for k, v in hf.state_dict().items()}
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
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for scaled in ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                   {"rope_parameters": {"rope_theta": 1000.0, "rope_type": "yarn", "factor": 2.0}}):
        cfg_path.write_text(json.dumps(cfg | scaled))
        with pytest.raises(ValueError, match="rope_scaling"):
            convert_mineworld(tmp_path / "hf", tmp_path / "out", h=3, w=4, n_a=2)
    cfg_path.write_text(json.dumps(cfg | {"num_attention_heads": 4}))
    with pytest.raises(ValueError, match="head_dim=8 is not hidden_size / num_attention_heads = 16"):
        convert_mineworld(tmp_path / "hf", tmp_path / "out", h=3, w=4, n_a=2)
    cfg_path.write_text(json.dumps(cfg | {"num_attention_heads": 4, "head_dim": None}))
    with pytest.raises(ValueError, match="k_proj.weight has shape"):
        convert_mineworld(tmp_path / "hf", tmp_path / "out", h=3, w=4, n_a=2)
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
    path = convert_mineworld(tmp_path / "hf", tmp_path / "conv", h=3, w=4, n_a=2)
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


def test_1d_rope_tables_equal_transformers_bit_for_bit_at_mineworld_head_dim():
    """head_dim 64 (every MineWorld size) over 5,552 slots (16 frames of 347): our cos/sin equal LLaMA's exactly
    (float32 inverse frequencies; float64-then-rounded ones differed in 10 of 32 and drifted the logits)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from mcar.core.rope import RoPE1D

    slots = 16 * 347
    config = LlamaConfig(hidden_size=2048, num_attention_heads=32, max_position_embeddings=slots, rope_theta=10000.0)
    theirs = LlamaRotaryEmbedding(config)
    pos = torch.arange(slots)[None]
    cos_t, sin_t = theirs(torch.zeros(1, dtype=torch.float32), pos)  # (1, S, 64): (cos | cos)
    ours = RoPE1D(64, 10000.0)
    coords = torch.zeros(1, slots, 4, dtype=torch.long)
    coords[..., 3] = pos
    cos, sin = ours(coords)
    assert torch.equal(ours.inv_freq, theirs.inv_freq)
    assert torch.equal(torch.cat([cos, cos], -1), cos_t) and torch.equal(torch.cat([sin, sin], -1), sin_t)


def test_a_ckpt_that_records_its_length_converts_at_that_length(tmp_path):
    """A MineWorld .ckpt keeps its transformer config in its hyper-parameters: a 32-frame one used to convert at the
    preset's 16 frames unless frames= was given."""
    hf = tiny_llama(tmp_path)
    state = {f"transformer.{k}": v for k, v in hf.state_dict().items()}
    frame_len = LAYOUT.frame_len
    torch.save({"state_dict": state, "hyper_parameters": {"model": {"config": {"max_position_embeddings":
                                                                                4 * frame_len}}}},
               tmp_path / "long.ckpt")
    path = convert_mineworld(tmp_path / "long.ckpt", tmp_path / "out", heads=8, h=3, w=4, n_a=2)
    assert torch.load(path, weights_only=True)["hyper_parameters"]["clip_frames"] == 4


def test_converted_logits_equal_transformers_bit_for_bit_at_mineworld_geometry(tmp_path):
    """A one-layer LLaMA with MineWorld's head_dim (64) and geometry (16 frames of 14 x 24 + 11 = 5,552 slots):
    every logit of the converted model equals transformers' exactly (float64 RoPE frequencies drifted them)."""
    layout, frames = Layout(14, 24, 11), 16
    slots = layout.n_slots(frames)
    cfg = transformers.LlamaConfig(
        vocab_size=CODES + 8, hidden_size=128, intermediate_size=192, num_attention_heads=2, num_key_value_heads=1,
        num_hidden_layers=1, max_position_embeddings=slots, rope_theta=10000.0, rms_norm_eps=1e-5,
        initializer_range=0.2, attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    path = convert_mineworld(tmp_path / "hf", tmp_path / "out", h=14, w=24, n_a=11, frames=frames)
    from mcar.checkpoint.load import load_model

    model = load_model(path, "cpu")[0].model.eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CODES, (1, slots), generator=g)
    act = ~layout.is_image(frames)
    x[:, act] = CODES + torch.randint(0, 6, (1, int(act.sum())), generator=g)
    with torch.no_grad():
        want = hf(input_ids=x, position_ids=torch.arange(slots)[None]).logits
        batch = CausalMask(layout, frames)(x)
        got = model(batch.tokens, batch.coords, batch.mask)
    assert torch.equal(got, want), (got - want).abs().amax(-1)[0].nonzero()[:5].flatten().tolist()


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
