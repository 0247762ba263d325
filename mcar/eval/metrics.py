"""Video quality scores: PSNR (mcar.tokenizer.quality) and SSIM (torchmetrics) per frame index, LPIPS and FVD,
and VBench's subject consistency, dynamic degree and imaging quality, each from a network that mcar.eval.networks
loads from a local weight file.

Frames are float in [0, 1], videos (B, T, 3, H, W). When a network is absent or fails, the score is
`Unavailable(reason)`, never a made-up number. The Fréchet distance itself is ours (float64, symmetric
eigendecompositions) and is tested against the eigenvalues of the non-symmetric product C1 C2. The intervals
over clips are mcar.eval.stats'.
"""
from __future__ import annotations

import math

import torch
from einops import rearrange
from torchmetrics.functional.image import structural_similarity_index_measure

from mcar.core.layout import Layout
from mcar.eval.networks import Unavailable
from mcar.tokenizer.clips import split_clip
from mcar.tokenizer.quality import psnr


# ------------------------------------------------------------------------------------------------ PSNR / SSIM
def _flat(gen: torch.Tensor, gt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if gen.shape != gt.shape or gen.dim() != 5:
        raise ValueError(f"videos must both be (B, T, 3, H, W); got {tuple(gen.shape)} and {tuple(gt.shape)}")
    return gen.flatten(0, 1).float(), gt.flatten(0, 1).float()  # (B*T, 3, H, W)


def psnr_per_frame(gen: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    """(B, T, 3, H, W) x2 in [0, 1] -> (B, T) PSNR in dB (float32); +inf where the frames are identical."""
    g, t = _flat(gen, gt)
    return psnr(g, t, data_range=1.0, dim=(1, 2, 3)).view(gen.shape[:2])


def psnr_pooled(gen: torch.Tensor, gt: torch.Tensor, dim=None) -> torch.Tensor:
    """PSNR (dB) of the mean squared error pooled over `dim` (None: every frame of every clip), for (B, T, 3, H, W)
    in [0, 1]; +inf only where all pooled frames are identical. The row value: a mean of per-frame PSNRs is +inf
    as soon as one generated frame equals its target (a "nothing moves" clip of tile-exact data), which would say
    nothing of the others."""
    # dim indexes (B, T); the MSE is also over each frame's (3, H, W)
    over = (0, 1) if dim is None else tuple(d % 2 for d in ((dim,) if isinstance(dim, int) else dim))
    # in float64: a frame equal to its target gives inf, never a rounding error's finite value
    return psnr(gen.double(), gt.double(), data_range=1.0, dim=(*over, 2, 3, 4))


def mse_per_clip(gen: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    """(B, T, 3, H, W) x2 -> (B,) float64 mean squared error of each clip: pooled over clips, the row's PSNR."""
    return (gen.double() - gt.double()).square().flatten(1).mean(1)


def ssim_per_frame(gen: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    """(B, T, 3, H, W) x2 in [0, 1] -> (B, T) SSIM (1 = identical)."""
    g, t = _flat(gen, gt)
    return structural_similarity_index_measure(g, t, data_range=1.0, reduction="none").view(gen.shape[:2])


def mean_over_clips(per_clip: torch.Tensor) -> list[float]:
    """(B, T) -> per frame index mean over clips (inf stays inf: identical frames)."""
    return per_clip.double().mean(0).tolist()


# ------------------------------------------------------------------------------------------------ tokens
def unchanged_per_clip(clips: torch.Tensor, layout: Layout, codebook_size: int, prompt_frames: int) -> torch.Tensor:
    """(B, N) -> (B,) float64: per clip, the share of generated image tokens equal to the token at the same place
    one frame earlier: how still the video is (copy_last: 1; the ground truth: how much the world really changes).
    Reads PSNR: a row that changes little scores near copy_last whether or not it follows the actions."""
    images = split_clip(clips, layout, codebook_size)[0]  # (B, T, h, w)
    P = max(1, prompt_frames)
    return (images[:, P:] == images[:, P - 1:-1]).double().flatten(1).mean(1)


# ------------------------------------------------------------------------------------------------ Fréchet
def feature_stats(feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, D) features -> mean (D,) and unbiased covariance (D, D), float64."""
    if feats.dim() != 2 or len(feats) < 2:
        raise ValueError(f"need (N >= 2, D) features for a covariance, got {tuple(feats.shape)}")
    x = feats.double()
    return x.mean(0), torch.cov(x.T)


def _sqrt_psd(a: torch.Tensor) -> torch.Tensor:
    """Square root of a symmetric positive semi-definite matrix (negative round-off eigenvalues -> 0)."""
    vals, vecs = torch.linalg.eigh((a + a.T) / 2)
    return (vecs * vals.clamp(min=0).sqrt()) @ vecs.T


def frechet_distance(mu1: torch.Tensor, cov1: torch.Tensor, mu2: torch.Tensor, cov2: torch.Tensor) -> float:
    """|mu1 - mu2|^2 + tr(C1 + C2 - 2 (C1 C2)^(1/2)) of two Gaussians, float64.

    tr (C1 C2)^(1/2) = tr (C1^(1/2) C2 C1^(1/2))^(1/2): the inner matrix is symmetric PSD, so two eigh calls
    replace the non-symmetric sqrtm (and its complex round-off) of the usual implementation.
    """
    mu1, cov1, mu2, cov2 = (x.double() for x in (mu1, cov1, mu2, cov2))
    s1 = _sqrt_psd(cov1)
    inner = torch.linalg.eigvalsh(s1 @ cov2 @ s1).clamp(min=0).sqrt().sum()
    d = (mu1 - mu2).square().sum() + cov1.trace() + cov2.trace() - 2 * inner
    return float(d.clamp(min=0))


def frechet_distance_of_features(f1: torch.Tensor, f2: torch.Tensor) -> float:
    return frechet_distance(*feature_stats(f1), *feature_stats(f2))


# ------------------------------------------------------------------------------------------------ FVD / LPIPS


@torch.no_grad()
def i3d_features(i3d, videos: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """(N, T, 3, H, W) in [0, 1] -> (N, D) I3D features (StyleGAN-V's calling convention)."""
    out = []
    for chunk in videos.split(batch_size):
        x = rearrange(chunk, "b t c h w -> b c t h w").float().mul(2).sub(1)  # in [-1, 1]
        out.append(i3d(x, rescale=False, resize=True, return_features=True).double().cpu())
    return torch.cat(out)


def fvd(i3d, gen: torch.Tensor, gt: torch.Tensor) -> float | Unavailable:
    """FVD between generated and real videos (N, T, 3, H, W) in [0, 1]; Unavailable if it cannot be computed."""
    if isinstance(i3d, Unavailable):
        return i3d
    if len(gen) < 2:
        return Unavailable(f"FVD needs >= 2 clips for a covariance, got {len(gen)}")
    try:
        return frechet_distance_of_features(i3d_features(i3d, gen), i3d_features(i3d, gt))
    except Exception as e:  # e.g. too few frames for I3D's temporal kernels
        return Unavailable(f"I3D failed on videos {tuple(gen.shape)}: {type(e).__name__}: {e}"[:300])


@torch.no_grad()
def lpips_per_frame(net, gen: torch.Tensor, gt: torch.Tensor, batch_size: int = 16) -> torch.Tensor | Unavailable:
    """(B, T, 3, H, W) x2 in [0, 1] -> (B, T) LPIPS distances (lower is closer), or Unavailable."""
    if isinstance(net, Unavailable):
        return net
    g, t = _flat(gen, gt)
    try:
        d = [net(a * 2 - 1, b * 2 - 1).reshape(len(a)) for a, b in zip(g.split(batch_size), t.split(batch_size))]
    except Exception as e:
        return Unavailable(f"LPIPS network failed: {type(e).__name__}: {e}"[:300])
    return torch.cat(d).float().view(gen.shape[:2])


# ---------------------------------------------------------------------------------- VBench: subject consistency


def subject_consistency(features: torch.Tensor) -> torch.Tensor:
    """(B, T, D) per-frame features -> (B,) VBench's subject consistency: over frames t >= 1, the mean of the
    cosine similarity to frame t-1 and to frame 0 (each clipped at 0), averaged over t."""
    f = torch.nn.functional.normalize(features.double(), dim=-1)
    previous = (f[:, 1:] * f[:, :-1]).sum(-1).clamp(min=0)
    first = (f[:, 1:] * f[:, :1]).sum(-1).clamp(min=0)
    return ((previous + first) / 2).mean(1)


@torch.no_grad()
def subject_consistency_per_clip(net, videos: torch.Tensor, batch_size: int = 32) -> torch.Tensor | Unavailable:
    """(B, T, 3, H, W) in [0, 1] -> (B,) subject consistency of each clip's frames (net: frames -> features), or
    Unavailable."""
    if isinstance(net, Unavailable):
        return net
    if videos.shape[1] < 2:
        return Unavailable(f"subject consistency needs >= 2 frames, got {videos.shape[1]}")
    try:
        feats = torch.cat([net(chunk).double().cpu() for chunk in videos.flatten(0, 1).split(batch_size)])
    except Exception as e:
        return Unavailable(f"DINO failed: {type(e).__name__}: {e}"[:300])
    return subject_consistency(feats.view(*videos.shape[:2], -1))


# --------------------------------------------------------------------------------------- VBench: dynamic degree


def top_flow(flow: torch.Tensor) -> torch.Tensor:
    """(N, 2, H, W) flow -> (N,) VBench's motion of a frame pair: the mean of its largest 5% flow magnitudes."""
    magnitude = flow.double().norm(dim=1).flatten(1)
    return magnitude.topk(max(1, int(magnitude.shape[1] * 0.05)), dim=1).values.mean(1)


def dynamic_degree(motion: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, T-1) top_flow of each clip's consecutive frame pairs -> (B,) 1.0 where the clip is dynamic, else 0.0:
    VBench's rule, at least round(4 T / 16) pairs (at least 1) move more than 6 pixels per 256 of the frame's
    short side."""
    frames = motion.shape[1] + 1
    threshold, pairs = 6.0 * min(height, width) / 256, max(1, round(4 * frames / 16))
    return ((motion > threshold).sum(1) >= pairs).double()


@torch.no_grad()
def dynamic_degree_per_clip(net, videos: torch.Tensor, batch_size: int = 8) -> torch.Tensor | Unavailable:
    """(B, T, 3, H, W) in [0, 1] -> (B,) VBench's dynamic degree of each clip, 1.0 or 0.0 (net: frame pairs
    (N, 3, H, W) x2 -> (N, 2, H', W') optical flow in pixels), or Unavailable."""
    if isinstance(net, Unavailable):
        return net
    B, T, _, H, W = videos.shape
    if T < 2:
        return Unavailable(f"dynamic degree needs >= 2 frames, got {T}")
    a, b = videos[:, :-1].flatten(0, 1), videos[:, 1:].flatten(0, 1)
    try:
        motion = torch.cat([top_flow(net(x, y)).cpu() for x, y in zip(a.split(batch_size), b.split(batch_size))])
    except Exception as e:
        return Unavailable(f"RAFT failed: {type(e).__name__}: {e}"[:300])
    return dynamic_degree(motion.view(B, T - 1), H, W)


# -------------------------------------------------------------------------------------- VBench: imaging quality


@torch.no_grad()
def imaging_quality_per_clip(net, videos: torch.Tensor, batch_size: int = 16) -> torch.Tensor | Unavailable:
    """(B, T, 3, H, W) in [0, 1] -> (B,) VBench's imaging quality of each clip: the mean over its frames of the
    quality net's score / 100 (net: frames (N, 3, H, W) -> (N,) on a 0-100 scale, MUSIQ's), or Unavailable."""
    if isinstance(net, Unavailable):
        return net
    try:
        scores = torch.cat([net(chunk).double().reshape(-1).cpu() for chunk in videos.flatten(0, 1).split(batch_size)])
    except Exception as e:
        return Unavailable(f"MUSIQ failed: {type(e).__name__}: {e}"[:300])
    return scores.view(videos.shape[:2]).mean(1) / 100


def fmt(x, digits: int = 2) -> str:
    """A table cell: numbers rounded, inf as 'inf', Unavailable/None as 'n/a'."""
    if x is None or isinstance(x, Unavailable):
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)
