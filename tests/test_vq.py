"""The diffusers VQModel tokenizer: x16 configs, the l2 quantizer's export to a plain VQModel, anti-collapse
measures, and the documented training command end to end (tiny)."""
import subprocess
import sys

import pytest
import torch
from diffusers import VQModel
from omegaconf import OmegaConf

from mcar.tokenizer.vq_model import (
    SMALL_WEIGHTS,
    L2Quantizer,
    build_vq,
    decode_tokens,
    encode_tokens,
    load_vq,
    save_vq,
    vq_id,
)
from tests.conftest import REPO, script_env
from tests.test_data_vpt import TINY_VQ


def arch(name):
    return OmegaConf.to_container(OmegaConf.load(REPO / "mcar" / "conf" / "vq" / f"{name}.yaml").arch)


def test_small_config_is_x16():
    vq = build_vq(arch("small")).eval()
    frames = torch.randint(0, 256, (1, 224, 384, 3), dtype=torch.uint8)
    ids = encode_tokens(vq, frames)
    assert ids.shape == (1, 14, 24) and 0 <= ids.min() and ids.max() < 1024
    assert decode_tokens(vq, ids).shape == (1, 3, 224, 384)
    assert sum(p.numel() for p in vq.parameters()) < 6e6


def test_amused_config_matches_diffusers():
    with torch.device("meta"):
        vq = VQModel(**arch("amused"))
    assert vq.config.num_vq_embeddings == 8192 and len(vq.config.block_out_channels) == 5  # 4 downsamples: x16
    assert vq.config.lookup_from_codebook


def test_l2_quantizer_exports_to_a_plain_vqmodel(tmp_path):
    torch.manual_seed(0)
    vq = build_vq(TINY_VQ).eval()
    assert isinstance(vq.quantize, L2Quantizer)
    x = torch.rand(2, 3, 64, 96) * 2 - 1
    with torch.no_grad():
        z_q, _, (_, _, ids) = vq.quantize(vq.encode(x).latents)
        rec = vq.decode(z_q, force_not_quantize=True).sample
    save_vq(vq, tmp_path / "vq")
    plain = VQModel.from_pretrained(str(tmp_path / "vq")).eval()  # no mcar code involved
    assert type(plain.quantize).__name__ == "VectorQuantizer"
    with torch.no_grad():
        plain_ids = plain.quantize(plain.encode(x).latents)[2][2]  # the project's token contract
        plain_rec = plain(x).sample
    assert torch.equal(plain_ids, ids)  # argmin |z - e| == argmax cos(z, e) for unit codes
    torch.testing.assert_close(plain_rec, rec, atol=1e-5, rtol=1e-4)
    assert vq_id(tmp_path / "vq").startswith("vq@")


def test_kmeans_init_and_dead_code_restarts():
    from mcar.train.vq_training import VQLit

    cfg = OmegaConf.create({"init_from": None, "l2_codes": True, "vq": {"arch": TINY_VQ}, "seed": 0,
                            "dead_threshold": 0.01})
    lit = VQLit(cfg)
    q = lit.vq.quantize
    batches = [torch.rand(4, 3, 64, 64) * 2 - 1 for _ in range(2)]
    lit.kmeans_init(batches)
    w = q.embedding.weight.detach()
    torch.testing.assert_close(w.norm(dim=-1), torch.ones(16))
    lit(batches[0])  # leaves the batch's encoder outputs for restarts
    lit.usage[:5] = 0.0  # five dead codes
    before = w.clone()
    lit.restart_dead_codes()
    after = q.embedding.weight.detach()
    assert int(lit.restarts) == 5 and not torch.equal(after[:5], before[:5]) and torch.equal(after[5:], before[5:])
    assert (lit.usage[:5] > cfg.dead_threshold).all()  # a grace period


def test_load_vq_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no diffusers VQModel at"):
        load_vq(tmp_path)


@pytest.mark.skipif(not (SMALL_WEIGHTS / "config.json").exists(), reason="small VQ weights not committed yet")
def test_committed_small_vq_loads():
    vq = load_vq()
    assert vq.config.num_vq_embeddings == 1024
    assert encode_tokens(vq, torch.zeros(1, 224, 384, 3, dtype=torch.uint8)).shape == (1, 14, 24)


@pytest.mark.slow
def test_vq_train_command_tiny(tmp_path):
    """`mcar vq_train` on generated Crafter episodes, tiny: best/ + last/ folders, metrics, PNG, resume."""
    base = [sys.executable, "-m", "mcar.cli", "vq_train", f"episodes={tmp_path}/eps", f"out={tmp_path}/out",
            "generate.episodes=3", "generate.frames=8", "generate.workers=1", "val_episodes=1", "val_per_episode=4",
            "val_stride=2", "crop=[64,64]", "batch_size=2", "val_every=3", "ckpt_every=3", "print_every=1",
            "kmeans_batches=1", "vq.arch.block_out_channels=[8,8,8,8,8]", "vq.arch.norm_num_groups=4",
            "vq.arch.latent_channels=4", "vq.arch.num_vq_embeddings=16", "vq.arch.vq_embed_dim=4",
            f"hydra.run.dir={tmp_path}/hydra"]
    r = subprocess.run(base + ["steps=3"], cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "out"
    assert "k-means init" in r.stdout and "val step 3: psnr" in r.stdout
    assert (out / "best" / "metrics.txt").exists() and (out / "recon" / "step000003.png").exists()
    assert VQModel.from_pretrained(str(out / "last")).config.num_vq_embeddings == 16
    r = subprocess.run(base + ["steps=6", "ckpt_path=last"], cwd=REPO, env=script_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "k-means init" not in r.stdout and "val step 6" in r.stdout  # resumed from step 3
