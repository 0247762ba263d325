"""mcar.tokenizer.quality.psnr, the one home of the PSNR formula: hand-computed values, +inf on identical images,
the reduction over `dim`, and every caller (eval metrics, VQ training/eval, vq_patches) agreeing with it."""
import math

import pytest
import torch

from mcar.tokenizer.quality import psnr


def test_hand_computed_values():
    zeros = torch.zeros(2, 2)
    # data_range 1: one pixel of four off by 0.5 -> MSE 0.25 / 4 = 1/16 -> 10 log10(16) = 12.0412 dB
    assert psnr(torch.tensor([[0.5, 0.0], [0.0, 0.0]]), zeros, 1.0).item() == pytest.approx(12.041200, abs=1e-5)
    # every pixel off by 0.1 -> MSE 0.01 -> 10 log10(100) = 20 dB
    assert psnr(torch.full((2, 2), 0.1, dtype=torch.float64), zeros.double(), 1.0).item() == pytest.approx(20.0)
    # data_range 255, uint8: every pixel off by 51 = 255 / 5 -> 10 log10(25) = 13.9794 dB
    u0 = torch.zeros(2, 2, dtype=torch.uint8)
    assert psnr(torch.full((2, 2), 51, dtype=torch.uint8), u0, 255.0).item() == pytest.approx(13.979400, abs=1e-5)
    # one pixel of four off by 255 -> MSE 255^2 / 4 -> 10 log10(4) = 6.0206 dB; order of the arguments is moot
    one = torch.tensor([[0, 0], [0, 255]], dtype=torch.uint8)
    assert psnr(one, u0, 255.0).item() == pytest.approx(6.020600, abs=1e-5) == psnr(u0, one, 255.0).item()


def test_identical_is_inf_unless_the_mse_is_floored():
    x = torch.rand(3, 4, 4)
    assert psnr(x, x.clone(), 1.0).item() == math.inf
    u = torch.randint(0, 256, (4, 4, 3), dtype=torch.uint8)
    assert psnr(u, u.clone(), 255.0).item() == math.inf
    # min_mse 1e-10 (the VQ trainer's floor) on data_range 1: 10 log10(1e10) = 100 dB
    assert psnr(x, x, 1.0, min_mse=1e-10).item() == pytest.approx(100.0, abs=1e-4)


def test_reduction_over_dim():
    a = torch.zeros(2, 3, 4, 5)
    b = torch.zeros(2, 3, 4, 5)
    b[0] = 0.1  # first item: MSE 0.01 -> 20 dB; second identical -> inf
    per_item = psnr(b, a, 1.0, dim=(1, 2, 3))
    assert per_item.shape == (2,)
    assert per_item[0].item() == pytest.approx(20.0, abs=1e-4) and per_item[1].item() == math.inf
    assert psnr(b, a, 1.0, dim=0).shape == (3, 4, 5)
    assert psnr(b, a, 1.0, dim=-1).shape == (2, 3, 4)
    pooled = psnr(b, a, 1.0)  # MSE over everything: 0.01 / 2 -> 10 log10(200) = 23.0103 dB
    assert pooled.shape == () and pooled.item() == pytest.approx(23.010300, abs=1e-4)


def test_dtype_follows_the_inputs_at_least_float32():
    assert psnr(torch.zeros(2, dtype=torch.uint8), torch.ones(2, dtype=torch.uint8), 255.0).dtype == torch.float32
    assert psnr(torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64), 1.0).dtype == torch.float64
    with pytest.raises(ValueError, match="shapes"):
        psnr(torch.zeros(2), torch.zeros(3), 1.0)


def test_every_former_psnr_site_agrees_with_the_home():
    """A caller that re-implements the formula (and drifts) fails here."""
    from mcar.eval import metrics as M
    from mcar.tokenizer.quality import frame_scores
    from mcar.tools import vq_patches

    g = torch.Generator().manual_seed(0)
    gt = torch.rand(2, 3, 3, 8, 8, generator=g)
    gen = (gt + 0.1 * torch.randn(gt.shape, generator=g)).clamp(0, 1)
    gen[0, 0] = gt[0, 0]  # one identical frame: inf per frame, finite pooled
    torch.testing.assert_close(M.psnr_per_frame(gen, gt), psnr(gen, gt, 1.0, dim=(2, 3, 4)), rtol=1e-6, atol=0)
    assert M.psnr_per_frame(gen, gt)[0, 0].item() == math.inf
    torch.testing.assert_close(M.psnr_pooled(gen, gt), psnr(gen.double(), gt.double(), 1.0), rtol=1e-12, atol=0)
    torch.testing.assert_close(M.psnr_pooled(gen, gt, dim=0), psnr(gen.double(), gt.double(), 1.0, dim=(0, 2, 3, 4)),
                               rtol=1e-12, atol=0)

    x = torch.rand(4, 3, 8, 8, generator=g) * 2 - 1  # VQ images in [-1, 1], compared on [0, 1], MSE floored
    rec = x + 0.2 * torch.randn(x.shape, generator=g)
    rec[0] = x[0]
    home = psnr((x + 1) / 2, (rec.clamp(-1, 1) + 1) / 2, 1.0, dim=(1, 2, 3), min_mse=1e-10)
    torch.testing.assert_close(frame_scores(x, rec)[0], home, rtol=1e-6, atol=0)
    assert frame_scores(x, rec)[0][0].item() == pytest.approx(100.0, abs=1e-4)

    u = torch.randint(0, 256, (2, 8, 8, 3), dtype=torch.uint8, generator=g)
    v = (u.int() + torch.randint(-20, 21, u.shape, generator=g)).clamp(0, 255).to(torch.uint8)
    assert vq_patches.psnr(v, u) == pytest.approx(psnr(v, u, 255.0).item(), rel=1e-6)
    assert vq_patches.psnr(u, u) == math.inf
