"""The networks behind mcar evaluate's scores (mcar.eval.metrics), each loaded from a local weight file the config
names; a file that is absent or fails to load gives `Unavailable(reason)`, shown in tables instead of a number.
Nothing downloads anything.

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

from dataclasses import dataclass
from pathlib import Path

import torch

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Unavailable:
    """A metric we cannot compute, with the reason (shown in tables instead of a number)."""

    reason: str

    def __str__(self) -> str:
        return f"unavailable: {self.reason}"


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
