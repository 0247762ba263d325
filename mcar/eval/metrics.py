"""Video quality metrics: PSNR (mcar.tokenizer.quality) and SSIM (torchmetrics) per frame index, LPIPS and FVD from
local weight files.

Frames are float in [0, 1], videos (B, T, 3, H, W). Networks we cannot ship (I3D for FVD, LPIPS) come from local
TorchScript files given by config; when a file is absent or fails, the metric is `Unavailable(reason)`, never a
made-up number. The Fréchet distance itself is ours (float64, symmetric eigendecompositions) and is tested
against the eigenvalues of the non-symmetric product C1 C2.

    FVD   i3d_torchscript.pt of StyleGAN-V / universome/fvd-comparison: called as
          i3d(videos (B, 3, T, H, W) in [-1, 1], rescale=False, resize=True, return_features=True) -> (B, 400)
    LPIPS any TorchScript module lpips(x, y), x and y (B, 3, H, W) in [-1, 1] -> (B,) or (B, 1, 1, 1) distances,
          e.g. torch.jit.trace(lpips.LPIPS(net="alex"), (x, y)).save("lpips_alex.pt") where `lpips` is installed
    VBench's subject consistency: DINO ViT-B/16 (facebook/dino-vitb16) as a local transformers folder
          (config.json + model.safetensors: weights only, no code runs), `pip install 'mcar[vbench]'`.
    VBench's dynamic degree: torchvision's RAFT (raft_large, weights Raft_Large_Weights.C_T_V1: the original
          raft-things.pth VBench uses, ported) as a state-dict file; imaging quality: pyiqa's MUSIQ trained on SPAQ
          (musiq_spaq_ckpt-358bb6af.pth, VBench's file). Both files are read weights-only (safetensors, or
          torch.load(weights_only=True): tensors only, no pickled code runs) into a model built here; neither
          library downloads anything. torchvision (and so pyiqa) does not import beside a CPU build of torch 2.13:
          install the pair first (`pip install torch==2.14.1 torchvision==0.29.1`), then `mcar[vbench]`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from einops import rearrange
from torchmetrics.functional.image import structural_similarity_index_measure

from mcar.core.layout import Layout
from mcar.tokenizer.clips import split_clip
from mcar.tokenizer.quality import psnr


@dataclass(frozen=True)
class Unavailable:
    """A metric we cannot compute, with the reason (shown in tables instead of a number)."""

    reason: str

    def __str__(self) -> str:
        return f"unavailable: {self.reason}"


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


# ------------------------------------------------------------------------------------------------ intervals
def bootstrap_ci(per_clip: torch.Tensor, pool, seed: int = 0, resamples: int = 1000,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap over clips: `resamples` draws of len(per_clip) clips with replacement (seeded), `pool`
    ((R, n) per-clip values -> (R,) statistics, the row value's own formula) on each -> the central `level`
    interval (low, high). The order statistics are taken as they are (no interpolation: inf stays inf)."""
    values = per_clip.double().cpu()
    g = torch.Generator().manual_seed(seed)
    return central(pool(values[torch.randint(len(values), (resamples, len(values)), generator=g)]), level)


def resample_seeds_and_clips(n_seeds: list[int], n_clips: int, seed: int = 0,
                             resamples: int = 1000) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The draws of a two-level bootstrap over models trained with several seeds, all scored on the same clips:
    for each model, (resamples, its seeds) seed indices drawn with replacement; one (resamples, n_clips) clip index
    draw shared by every model (the clips are paired across models)."""
    g = torch.Generator().manual_seed(seed)
    clips = torch.randint(n_clips, (resamples, n_clips), generator=g)
    return [torch.randint(s, (resamples, s), generator=g) for s in n_seeds], clips


def pooled_draws(values: torch.Tensor, seeds: torch.Tensor, clips: torch.Tensor, pool) -> torch.Tensor:
    """(S, n) per-clip values of S seeds -> (resamples,) `pool` of the drawn seeds' drawn clips (each draw: the
    seeds `seeds[r]`, each on the clips `clips[r]`, pooled together)."""
    drawn = values.double()[seeds[:, :, None], clips[:, None, :]]  # (R, S, n)
    return pool(drawn.flatten(1))


def central(draws: torch.Tensor, level: float = 0.95) -> tuple[float, float]:
    """The central `level` interval of bootstrap draws, order statistics as they are (as bootstrap_ci)."""
    d = draws.double().sort().values
    tail, last = (1 - level) / 2, len(d) - 1
    return float(d[math.floor(tail * last)]), float(d[math.ceil((1 - tail) * last)])


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


# ------------------------------------------------------------------------------------------------ weight files
def load_torchscript(path: str | None, what: str, config_key: str,
                     trust_code=()) -> torch.jit.ScriptModule | Unavailable:
    """A TorchScript network from a local file, or Unavailable naming the config key and the path. TorchScript is a
    program: loading and calling it runs whatever it holds, so only a file the user names in `trust_code` is
    loaded; any other is refused before torch reads it."""
    if not path:
        return Unavailable(f"no {what} weights: set {config_key}=/path/to/file")
    if not Path(path).is_file():
        return Unavailable(f"{what} weights not found: {config_key}={path}")
    if Path(path).resolve() not in {Path(p).resolve() for p in trust_code or ()}:
        raise ValueError(f"{config_key}={path} is a TorchScript program, which runs its own code when loaded and "
                         f"called: if you trust the file (e.g. the publisher's own release), run it by name with "
                         f"trust_code=[{path}]")
    try:
        return torch.jit.load(str(path), map_location="cpu").eval()
    except Exception as e:  # not TorchScript, truncated, ...
        return Unavailable(f"cannot load {what} weights {path}: {type(e).__name__}: {e}"[:300])


def load_weights(path: str | None, what: str, config_key: str) -> dict | Unavailable:
    """A state dict of tensors from a local file, read without running code: safetensors, or torch.load weights-only
    (mcar.checkpoint.io: a pickle holding anything else is refused, naming the file); a DataParallel 'module.'
    prefix is dropped, as VBench and pyiqa do. Unavailable naming the key when no file is set or found."""
    if not path:
        return Unavailable(f"no {what} weights: set {config_key}=/path/to/file")
    if not Path(path).is_file():
        return Unavailable(f"{what} weights not found: {config_key}={path}")
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        try:
            state = load_file(str(path))
        except Exception as e:  # truncated, not safetensors
            raise ValueError(f"cannot read {config_key}={path}: {type(e).__name__}: {e}") from e
    else:
        from mcar.checkpoint.io import load_weights_only  # here: it imports Lightning, which metrics need not

        state = load_weights_only(path, f"{what} weights ({config_key})")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{config_key}={path}: not a flat state dict (name -> tensor): save the model's state_dict() "
                         f"alone")
    return {k.removeprefix("module."): v for k, v in state.items()}


def _fit(state: dict, model: torch.nn.Module) -> str:
    """'' when `state` has exactly the model's keys and shapes, else a few words on the first mismatch."""
    own = model.state_dict()
    missing, extra = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    if missing or extra:
        return f"{len(missing)} keys missing (e.g. {missing[:1]}), {len(extra)} unexpected (e.g. {extra[:1]})"
    bad = next((k for k in own if own[k].shape != state[k].shape), None)
    return f"{bad} is {tuple(state[bad].shape)}, the model's {tuple(own[bad].shape)}" if bad else ""


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
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class DinoFeatures(torch.nn.Module):
    """A transformers ViT as VBench calls DINO: frames (N, 3, H, W) in [0, 1], short side resized to the model's
    image size, ImageNet-normalised -> (N, D) class-token features."""

    def __init__(self, vit):
        super().__init__()
        self.vit, self.size = vit, int(vit.config.image_size)

    @torch.no_grad()
    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        h, w = frames.shape[-2:]
        scale = self.size / min(h, w)
        x = torch.nn.functional.interpolate(frames.float(), size=(round(h * scale), round(w * scale)),
                                            mode="bicubic", align_corners=False).clamp(0, 1)
        mean, std = (torch.tensor(v, device=x.device).view(1, 3, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))
        out = self.vit(pixel_values=(x - mean) / std, interpolate_pos_encoding=True)
        return out.last_hidden_state[:, 0]


def load_dino(path: str | None, config_key: str = "vbench.dino") -> DinoFeatures | Unavailable:
    """DINO from a local transformers folder (config.json + model.safetensors), weights only; Unavailable naming
    the key when no path is set, the files are missing or transformers is not installed."""
    if not path:
        return Unavailable(f"no DINO weights: set {config_key}=/path/to/dino-vitb16 (config.json + model.safetensors)")
    folder = Path(path)
    missing = [f for f in ("config.json", "model.safetensors") if not (folder / f).is_file()]
    if missing:
        return Unavailable(f"{config_key}={path}: no {' or '.join(missing)} there (a transformers ViT folder, "
                           f"safetensors weights)")
    try:
        from transformers import ViTModel
    except ImportError:
        return Unavailable(f"{config_key} needs transformers: pip install 'mcar[vbench]'")
    vit = ViTModel.from_pretrained(folder, use_safetensors=True, local_files_only=True, add_pooling_layer=False)
    return DinoFeatures(vit.eval())


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
RAFT_UPDATES = 20  # VBench: RAFT(image1, image2, iters=20, test_mode=True)


class RaftFlow(torch.nn.Module):
    """torchvision's RAFT as VBench calls it: frame pairs (N, 3, H, W) in [0, 1] scaled to [-1, 1] (what the
    original RAFT makes of VBench's 0-255 frames), edge-padded to a multiple of 8 as VBench's InputPadder does, 20
    flow updates -> (N, 2, H', W') flow of the last update in pixels, on the padded frame (VBench scores that)."""

    def __init__(self, raft, updates: int = RAFT_UPDATES):
        super().__init__()
        self.raft, self.updates = raft, updates

    @torch.no_grad()
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h, w = a.shape[-2:]
        ph, pw = -h % 8, -w % 8
        pad = (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2)
        if min(h + ph, w + pw) < 128:  # torchvision's correlation pyramid needs 16 x 16 feature maps
            raise ValueError(f"torchvision's RAFT needs frames of at least 128 pixels a side, got {h}x{w}")
        a, b = (torch.nn.functional.pad(x.float() * 2 - 1, pad, mode="replicate") for x in (a, b))
        return self.raft(a, b, num_flow_updates=self.updates)[-1]


def load_raft(path: str | None, config_key: str = "vbench.raft") -> RaftFlow | Unavailable:
    """torchvision's raft_large (or raft_small, by the file's keys) with the weights of a local state-dict file,
    read weights-only; Unavailable naming the key when no path is set, the file is missing or torchvision does not
    import; a file that is not RAFT's weights is refused."""
    if not path:
        return Unavailable(f"no RAFT weights: set {config_key}=/path/to/raft_large_C_T_V1-22a6c225.pth (torchvision's "
                           f"port of VBench's raft-things.pth)")
    state = load_weights(path, "RAFT", config_key)
    if isinstance(state, Unavailable):
        return state
    try:
        from torchvision.models.optical_flow import raft_large, raft_small
    except (ImportError, RuntimeError) as e:  # RuntimeError: a torchvision built for another torch
        return Unavailable(f"{config_key} needs torchvision built for this torch ({type(e).__name__}: "
                           f"{str(e)[:120]}): pip install torch==2.14.1 torchvision==0.29.1 'mcar[vbench]'")
    why = {}
    for build in (raft_large, raft_small):
        net = build(weights=None, progress=False)
        why[build.__name__] = _fit(state, net)
        if not why[build.__name__]:
            net.load_state_dict(state)
            return RaftFlow(net.eval())
    raise ValueError(f"{config_key}={path}: not torchvision RAFT weights (raft_large: {why['raft_large']}; "
                     f"raft_small: {why['raft_small']}): use raft_large_C_T_V1-22a6c225.pth")


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
MUSIQ_LONGER_SIDE = 512  # VBench's default 'longer' preprocessing: a longer side above 512 is resized to 512


class MusiqQuality(torch.nn.Module):
    """pyiqa's MUSIQ as VBench calls it for imaging quality: frames (N, 3, H, W) in [0, 1], a longer side above 512
    brought to 512 (bilinear, no antialias: VBench's transforms.Resize on tensors) -> (N,) MUSIQ scores (SPAQ's
    0-100 scale). VBench scores one frame at a time; a batch of same-sized frames gives the same scores."""

    def __init__(self, musiq):
        super().__init__()
        self.musiq = musiq

    @torch.no_grad()
    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        h, w = frames.shape[-2:]
        x = frames.float()
        if max(h, w) > MUSIQ_LONGER_SIDE:
            scale = MUSIQ_LONGER_SIDE / max(h, w)
            x = torch.nn.functional.interpolate(x, size=(int(scale * h), int(scale * w)), mode="bilinear",
                                                align_corners=False, antialias=False)
        return self.musiq(x).reshape(len(x))


def load_musiq(path: str | None, config_key: str = "vbench.musiq") -> MusiqQuality | Unavailable:
    """pyiqa's MUSIQ (SPAQ's single-score head) built without weights, so pyiqa downloads nothing, then given the
    local file's weights read weights-only (pyiqa's own loader, which VBench calls, unpickles with
    weights_only=False: any code a file holds would run); Unavailable naming the key when no path is set, the file
    is missing or pyiqa does not import; a file that is not MUSIQ's weights is refused."""
    if not path:
        return Unavailable(f"no MUSIQ weights: set {config_key}=/path/to/musiq_spaq_ckpt-358bb6af.pth (pyiqa's MUSIQ "
                           f"on SPAQ, VBench's file)")
    state = load_weights(path, "MUSIQ", config_key)
    if isinstance(state, Unavailable):
        return state
    try:
        from pyiqa.archs.musiq_arch import MUSIQ
    except Exception as e:  # pyiqa imports torchvision, cv2, scipy, ...: any of them failing is pyiqa not importing
        return Unavailable(f"{config_key} needs pyiqa and a torchvision built for this torch ({type(e).__name__}: "
                           f"{str(e)[:120]}): pip install torch==2.14.1 torchvision==0.29.1 'mcar[vbench]'")
    net = MUSIQ(num_class=1, pretrained=False, pretrained_model_path=None)
    why = _fit(state, net)
    if why:
        raise ValueError(f"{config_key}={path}: not MUSIQ weights with SPAQ's single-score head ({why}): use "
                         f"musiq_spaq_ckpt-358bb6af.pth")
    net.load_state_dict(state)
    return MusiqQuality(net.eval())


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
