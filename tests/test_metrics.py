"""Metric math: the Fréchet distance against an eigenvalue reference, PSNR/SSIM extremes, unavailable weights, action
scores."""
import math

import numpy as np
import pytest
import torch

from mcar.core.layout import Layout
from mcar.eval import metrics as M
from mcar.eval import networks as N
from mcar.eval.action_following import check_idm_fits
from mcar.idm.model import InverseDynamics
from mcar.idm.scores import action_scores, frame_pairs


def reference_frechet(f1: np.ndarray, f2: np.ndarray) -> float:
    """The FID/FVD papers' formula through numpy alone: tr sqrtm(C1 C2) is the sum of the square roots of the
    eigenvalues of the non-symmetric product C1 C2 (real and >= 0: it is similar to a PSD matrix), where ours takes
    two symmetric eigendecompositions."""
    mu1, mu2 = f1.mean(0), f2.mean(0)
    s1, s2 = np.cov(f1, rowvar=False), np.cov(f2, rowvar=False)
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvals(s1 @ s2).real, 0, None)).sum()
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2) - 2 * tr_covmean)


@pytest.mark.parametrize("n,d,shift", [(64, 8, 0.0), (64, 8, 0.5), (200, 16, 2.0), (10, 24, 1.0)])
def test_frechet_distance_matches_the_eigenvalue_reference(n, d, shift):
    g = torch.Generator().manual_seed(n + d)
    f1 = torch.randn(n, d, generator=g, dtype=torch.float64)
    mix = torch.randn(d, d, generator=g, dtype=torch.float64) * 0.5
    f2 = torch.randn(n, d, generator=g, dtype=torch.float64) @ mix + shift
    ours = M.frechet_distance_of_features(f1, f2)
    ref = reference_frechet(f1.numpy(), f2.numpy())
    assert ours == pytest.approx(ref, rel=1e-6, abs=1e-6)  # n=10 < d=24: singular covariances too


def test_frechet_distance_closed_forms():
    assert M.frechet_distance_of_features(*(torch.randn(50, 6, generator=torch.Generator().manual_seed(0)),) * 2) \
        == pytest.approx(0, abs=1e-8)
    # diagonal Gaussians: |mu1-mu2|^2 + sum (sqrt(a) - sqrt(b))^2
    a, b, mu = torch.tensor([1.0, 4.0, 9.0]), torch.tensor([4.0, 1.0, 9.0]), torch.tensor([1.0, 0.0, 2.0])
    want = 5.0 + ((a.sqrt() - b.sqrt()) ** 2).sum().item()
    assert M.frechet_distance(mu, torch.diag(a), torch.zeros(3), torch.diag(b)) == pytest.approx(want)


def test_psnr_of_ground_truth_is_infinite_and_of_noise_low():
    g = torch.Generator().manual_seed(0)
    gt = torch.rand(2, 3, 3, 32, 48, generator=g)
    assert torch.isinf(M.psnr_per_frame(gt, gt)).all()
    assert torch.allclose(M.ssim_per_frame(gt, gt), torch.ones(2, 3))
    noise = torch.rand(2, 3, 3, 32, 48, generator=g)
    assert (M.psnr_per_frame(noise, gt) < 10).all()  # uniform noise vs uniform noise: ~7.8 dB
    slightly = (gt + 0.01 * torch.randn(gt.shape, generator=g)).clamp(0, 1)
    assert (M.psnr_per_frame(slightly, gt) > 35).all()
    assert M.mean_over_clips(M.psnr_per_frame(gt, gt)) == [math.inf] * 3


class FakeI3D(torch.nn.Module):
    """Stands in for i3d_torchscript.pt: same call signature, features = per-channel moments."""

    def forward(self, x: torch.Tensor, rescale: bool = False, resize: bool = False, return_features: bool = False):
        return torch.cat([x.mean((2, 3, 4)), x.std((2, 3, 4)), x[:, :, 1:].sub(x[:, :, :-1]).abs().mean((2, 3, 4))], 1)


class FakeLPIPS(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x - y).square().mean((1, 2, 3))


def test_weights_from_local_torchscript_files_or_unavailable_with_the_reason(tmp_path):
    missing = N.load_torchscript(str(tmp_path / "i3d_torchscript.pt"), "I3D", "fvd.i3d")
    assert isinstance(missing, N.Unavailable)
    assert "fvd.i3d=" in missing.reason and "i3d_torchscript.pt" in missing.reason
    assert isinstance(N.load_torchscript(None, "LPIPS", "lpips"), N.Unavailable)
    (tmp_path / "junk.pt").write_text("not torchscript")
    junk = N.load_torchscript(str(tmp_path / "junk.pt"), "I3D", "fvd.i3d", [tmp_path / "junk.pt"])
    assert "cannot load" in junk.reason
    videos = torch.rand(4, 5, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    assert isinstance(M.fvd(missing, videos, videos), N.Unavailable)
    assert M.fmt(missing) == "n/a"

    torch.jit.script(FakeI3D()).save(str(tmp_path / "i3d.pt"))
    torch.jit.script(FakeLPIPS()).save(str(tmp_path / "lpips.pt"))
    with pytest.raises(ValueError, match=rf"fvd.i3d={tmp_path}/i3d.pt is a TorchScript program.*"
                                         rf"trust_code=\[{tmp_path}/i3d.pt\]"):
        N.load_torchscript(str(tmp_path / "i3d.pt"), "I3D", "fvd.i3d")  # refused before torch reads it
    trusted = [str(tmp_path / "i3d.pt"), str(tmp_path / "lpips.pt"), str(tmp_path / "junk.pt")]
    i3d = N.load_torchscript(str(tmp_path / "i3d.pt"), "I3D", "fvd.i3d", trusted)
    assert M.fvd(i3d, videos, videos) == pytest.approx(0, abs=1e-9)
    assert M.fvd(i3d, videos.flip(0).mul(0.5), videos) > 0.01
    assert "2 clips" in M.fvd(i3d, videos[:1], videos[:1]).reason
    lp = M.lpips_per_frame(N.load_torchscript(str(tmp_path / "lpips.pt"), "LPIPS", "lpips", trusted), videos, videos)
    assert lp.shape == (4, 5) and float(lp.abs().max()) == 0


def test_action_scores_per_action_precision_recall_f1():
    pred, true = torch.tensor([0, 0, 1, 2, 2, 2]), torch.tensor([0, 1, 1, 2, 2, 0])
    s = action_scores(pred, true, {0: "noop", 1: "left", 2: "right"})
    assert s["accuracy"] == pytest.approx(4 / 6)
    assert s["per_action"]["noop"] == dict(precision=0.5, recall=0.5, f1=0.5, support=2)
    assert s["per_action"]["left"]["precision"] == 1.0 and s["per_action"]["left"]["recall"] == 0.5
    assert s["per_action"]["right"]["recall"] == 1.0 and s["per_action"]["right"]["precision"] == pytest.approx(2 / 3)
    assert s["macro_f1"] == pytest.approx((0.5 + 2 / 3 + 0.8) / 3)


def test_frame_pairs_follow_the_layout():
    lay, cb = Layout(2, 3, 2), 10
    T = 4
    clip = torch.cat([torch.cat([torch.full((6,), t), torch.tensor([cb + t, cb + 5])]) for t in range(T)])[None]
    a, b, act = frame_pairs(clip, lay, cb, first=1)
    assert a.shape == (2, 2, 3)
    assert a[:, 0, 0].tolist() == [1, 2] and b[:, 0, 0].tolist() == [2, 3]
    assert act.tolist() == [[1, 5], [2, 5]]  # a[t] leads from frame t to frame t+1
    idm = InverseDynamics(cb, 2, 8, dim=4, hidden=8)
    assert idm(a, b).shape == (2, 2, 8) and idm.predict(a, b).shape == (2, 2)


def test_an_idm_of_other_tokens_is_unavailable_with_the_reason():
    class Data:
        tokens_dir = "data/crafter/tokens_vq_crafter_small_new"

    idm = InverseDynamics(10, 1, 17, dim=4, hidden=8)
    idm.meta = {"tokens": "tokens_vq_crafter_small_old"}
    assert "another VQ" in check_idm_fits(idm, Data(), 10, 1, 17).reason
    assert "codebook 10" in check_idm_fits(idm, Data(), 1024, 1, 17).reason
    idm.meta = {"tokens": "tokens_vq_crafter_small_new"}
    assert check_idm_fits(idm, Data(), 10, 1, 17) is idm


def test_mask_image_is_the_pooled_dense_mask():
    from mcar.core.schedule import Schedule
    from mcar.tokenizer.pictures import mask_image

    table = Schedule(Layout(3, 4, 2), 3, 1, k=2).table()
    dense = table.dense().float()
    assert (mask_image(table, max_px=4096) == dense.mul(255).round().to(torch.uint8).numpy()).all()
    small = mask_image(table, max_px=10)  # pooled by ceil(S / 10)
    f = -(-len(table.pos) // 10)
    ref = torch.nn.functional.avg_pool2d(dense[None, None], f, ceil_mode=True)[0, 0].mul(255).round()
    assert small.shape == tuple(ref.shape) and np.abs(small.astype(int) - ref.numpy().astype(int)).max() <= 1


def test_pooled_psnr_stays_finite_when_one_frame_is_exact():
    """The row PSNR pools the MSE: one identical frame among others does not make it +inf (a mean of per-frame
    PSNRs would); identical everywhere is +inf; it equals 10 log10(1 / MSE) written out."""
    g = torch.Generator().manual_seed(0)
    gt = torch.rand(2, 3, 3, 8, 8, generator=g)
    gen = gt.clone()
    gen[1, 2] = torch.rand(3, 8, 8, generator=g)  # one wrong frame of six
    assert torch.isinf(M.psnr_per_frame(gen, gt)).any()
    pooled = float(M.psnr_pooled(gen, gt))
    mse = sum(float(((gen[b, t] - gt[b, t]) ** 2).mean()) for b in range(2) for t in range(3)) / 6
    assert math.isfinite(pooled) and pooled == pytest.approx(10 * math.log10(1 / mse))
    per_frame_index = M.psnr_pooled(gen, gt, dim=0)
    assert torch.isinf(per_frame_index[:2]).all() and math.isfinite(float(per_frame_index[2]))
    assert math.isinf(float(M.psnr_pooled(gt, gt)))


# ---- VBench's subject consistency ------------------------------------------------------------------------------
class PooledPixels(torch.nn.Module):
    """A stand-in feature net: each frame's 8x8 average-pooled pixels, centred (what DINO's place takes in tests)."""

    def forward(self, frames):
        x = torch.nn.functional.adaptive_avg_pool2d(frames, 8).flatten(1)
        return x - x.mean(1, keepdim=True)


def test_subject_consistency_is_vbenchs_formula():
    """Over frames t >= 1: mean of cos(f_t, f_t-1) and cos(f_t, f_0), each clipped at 0; identical frames 1."""
    from mcar.eval.metrics import subject_consistency

    same = torch.ones(2, 5, 3)
    assert torch.allclose(subject_consistency(same), torch.ones(2, dtype=torch.float64))
    flip = torch.tensor([[[1.0, 0.0], [-1.0, 0.0], [1.0, 0.0]]])  # cos -1 to the previous: clipped to 0
    assert subject_consistency(flip).item() == pytest.approx(((0 + 0) / 2 + (0 + 1) / 2) / 2)
    turn = torch.tensor([[[1.0, 0.0], [1.0, 1.0]]])  # 45 degrees from both the previous and the first frame
    assert subject_consistency(turn).item() == pytest.approx(math.cos(math.pi / 4))


def test_subject_consistency_orders_static_moving_and_noise_frames():
    """Frames built to differ: a still scene scores 1, the same scene panning lower, noise lowest."""
    from mcar.eval.metrics import subject_consistency_per_clip

    g = torch.Generator().manual_seed(0)
    scene = torch.nn.functional.interpolate(torch.rand(1, 3, 2, 4, generator=g), size=(32, 64), mode="bilinear")
    still = scene.repeat(6, 1, 1, 1)
    panning = torch.stack([scene[0].roll(2 * t, dims=-1) for t in range(6)])  # 2 pixels a frame
    noise = torch.rand(6, 3, 32, 64, generator=g)
    s = subject_consistency_per_clip(PooledPixels(), torch.stack([still, panning, noise]))
    assert s[0].item() == pytest.approx(1.0) and s[0] > s[1] > 0.5 > s[2]


def test_dino_loads_weights_only_from_a_local_folder_or_says_which_path_to_set(tmp_path):
    from mcar.eval.networks import Unavailable, load_dino

    assert "set vbench.dino=/path/to/dino-vitb16" in load_dino(None).reason
    missing = load_dino(str(tmp_path))
    assert isinstance(missing, Unavailable) and "no config.json or model.safetensors there" in missing.reason
    transformers = pytest.importorskip("transformers")  # the [vbench] extra; CI checks the formula and plumbing above
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32)
    transformers.ViTModel(cfg, add_pooling_layer=False).save_pretrained(tmp_path, safe_serialization=True)
    net = load_dino(str(tmp_path))
    assert net(torch.rand(3, 3, 32, 64)).shape == (3, 16)  # short side to 32, positions interpolated


def test_scoring_gives_subject_consistency_per_clip_with_its_interval_or_says_why_not(monkeypatch):
    """score(): SUBJ from the decoded frames of the last prompt frame on (copy_last: a still video, 1), with a
    bootstrap interval and per-clip values; without a DINO net the column is n/a and the notes say why."""
    from mcar.eval.scoring import Scorer, reference_clips, score

    layout, cb, P = Layout(2, 3, 1), 4, 1
    gt, missing, base = token_video_scoring(monkeypatch, P)
    nets = {"i3d": missing, "lpips": missing, "idm": missing, "raft": missing, "musiq": missing}
    still = reference_clips("copy_last", gt, layout, P, cb)
    row, _, extra = score(still, gt, scorer=Scorer(**base, nets=nets | {"dino": PooledPixels()}))
    assert row["subject_consistency"] == pytest.approx(1.0)
    assert row["subject_consistency_lo"] <= 1.0 + 1e-9 and len(extra["per_clip"]["subject_consistency"]) == 5
    row, _, _ = score(gt, gt, scorer=Scorer(**base, nets=nets | {"dino": PooledPixels()}))
    assert row["subject_consistency"] < 1.0  # the real clips change
    row, _, _ = score(gt, gt, scorer=Scorer(**base, nets=nets | {"dino": N.load_dino(None)}))
    assert isinstance(row["subject_consistency"], N.Unavailable) and "subject_consistency: no DINO weights" in \
        row["notes"]


def token_video_scoring(monkeypatch, prompt_frames: int):
    """What the scoring tests share: 5 random 4-frame clips of a 2 x 3 layout whose pixels are their tokens (each
    token a 4 x 4 grey patch, as a VQ decoding would give them: scoring._pixels replaced), a missing net, and the
    Scorer's fixed arguments -> (clips, missing, base)."""
    from mcar.eval import scoring
    from mcar.tokenizer.clips import join_clip

    layout, cb, T = Layout(2, 3, 1), 4, 4
    g = torch.Generator().manual_seed(0)
    gt = torch.stack([join_clip(torch.randint(0, cb, (T, 2, 3), generator=g), torch.zeros(T, 1, dtype=torch.long),
                                cb) for _ in range(5)])

    def pixels(scorer, gen, real):
        as_video = lambda clips: (clips.view(len(clips), T, -1)[:, :, :6].float() / cb).view(len(clips), T, 1, 2, 3)
        return tuple(as_video(c).expand(-1, -1, 3, -1, -1).repeat_interleave(4, -1).repeat_interleave(4, -2)
                     for c in (gen, real))

    monkeypatch.setattr(scoring, "_pixels", pixels)
    return gt, N.Unavailable("no weights"), dict(layout=layout, codebook_size=cb, prompt_frames=prompt_frames,
                                                 vq=None, names={})
