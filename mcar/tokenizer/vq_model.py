"""The image tokenizer: a diffusers `VQModel`; `downsample(vq)` pixels per token side, read from its architecture
(x16 for both VQs of conf/vq: 224x384 frames -> 14x24 token ids).

Token ids are always `vq.quantize(vq.encode(x).latents)[2][2]` with x in [-1, 1], (B, 3, H, W).

Training uses `L2Quantizer` (a drop-in subclass of diffusers' VectorQuantizer with the same parameters): lookup by
cosine similarity on l2-normalised low-dimensional codes (ViT-VQGAN, LlamaGen). Saved weights hold the
normalised codebook, so diffusers' own Euclidean lookup on the raw latent picks the same code (argmin |z - e|
= argmax z.e when |e| = 1) and returns the same vector: the saved folder is a plain VQModel that
`VQModel.from_pretrained` loads with no mcar code.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import VQModel
from diffusers.models.autoencoders.vae import VectorQuantizer
from einops import rearrange

from mcar.tokenizer.patch_vq import PatchVQ, is_patch_vq_folder

ASSETS = Path(__file__).parents[1] / "assets"  # mcar/assets
SMALL_WEIGHTS = ASSETS / "vq_crafter_small"  # the committed small Crafter VQ (a diffusers folder)


class L2Quantizer(VectorQuantizer):
    """Nearest code by cosine similarity; keeps the last batch's inputs and ids for dead-code restarts."""

    def forward(self, z: torch.Tensor):
        B, D, H, W = z.shape
        z = F.normalize(rearrange(z, "b d h w -> (b h w) d"), dim=-1)  # on the unit sphere
        codes = F.normalize(self.embedding.weight, dim=-1)  # (K, D)
        idx = (z @ codes.t()).argmax(1)  # (B*H*W,)
        z_q = codes[idx]
        loss = F.mse_loss(z_q, z.detach()) + self.beta * F.mse_loss(z, z_q.detach())  # codebook + commitment
        self.last_z, self.last_idx = z.detach(), idx.detach()
        z_q = z + (z_q - z).detach()  # straight-through
        return rearrange(z_q, "(b h w) d -> b d h w", b=B, h=H, w=W), loss, (None, None, idx)


def build_vq(arch: dict, l2_codes: bool = True) -> VQModel:
    """A fresh VQModel from diffusers kwargs (conf/vq/*.yaml `arch`), with the training quantizer."""
    vq = VQModel(**dict(arch))
    if l2_codes:
        use_l2_quantizer(vq)
    return vq


def use_l2_quantizer(vq: VQModel) -> VQModel:
    q = vq.quantize
    l2 = L2Quantizer(q.n_e, q.vq_embed_dim, beta=q.beta)
    l2.embedding.weight.data.copy_(q.embedding.weight.data)
    vq.quantize = l2
    return vq


def save_vq(vq: VQModel, path: str | Path, half: bool = False) -> None:
    """A plain diffusers folder (config.json + safetensors) with the codebook l2-normalised.

    half: store fp16 weights (half the file; from_pretrained loads them back as fp32).
    """
    out = copy.deepcopy(vq).cpu()
    if isinstance(out.quantize, L2Quantizer):
        w = out.quantize.embedding.weight.data
        w.copy_(F.normalize(w, dim=-1))
    (out.half() if half else out).save_pretrained(str(path), safe_serialization=True)


def load_vq(path: str | Path | None = None) -> VQModel:
    """A VQModel from a diffusers folder (or a PatchVQ folder: mcar.tokenizer.patch_vq); None -> the committed
    small Crafter VQ."""
    path = Path(path) if path else SMALL_WEIGHTS
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no diffusers VQModel at {path} (expected {path}/config.json and weights); "
                                f"set vq.path to a folder saved by save_pretrained / mcar vq_train")
    if is_patch_vq_folder(path):
        return PatchVQ.from_pretrained(path)
    try:  # diffusers reads .bin weights with weights_only=True: a pickle that would run code is refused there
        return VQModel.from_pretrained(str(path), low_cpu_mem_usage=False).eval()  # no `accelerate` needed
    except Exception as e:
        raise ValueError(f"cannot load the VQ at {path}: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from e


def to_input(frames_u8: torch.Tensor) -> torch.Tensor:
    """(B, H, W, 3) uint8 -> (B, 3, H, W) float in [-1, 1]."""
    return rearrange(frames_u8, "b h w c -> b c h w").float().div(127.5).sub(1)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> (B, H, W, 3) uint8."""
    return rearrange(x.clamp(-1, 1).add(1).mul(127.5).round().to(torch.uint8), "b c h w -> b h w c")


def downsample(vq_or_arch) -> int:
    """Pixels per token side of a VQModel (or its `arch` kwargs): every encoder block but the last halves the
    frame, so 2 ** (len(block_out_channels) - 1); a PatchVQ's (or an arch with `patch`) is its patch size."""
    if isinstance(vq_or_arch, PatchVQ):
        return vq_or_arch.patch
    arch = vq_or_arch.config if isinstance(vq_or_arch, VQModel) else vq_or_arch
    if arch.get("patch"):
        return int(arch["patch"])
    return 2 ** (len(arch["block_out_channels"]) - 1)


def frame_size(vq_or_arch, h: int, w: int, what: str = "data.h, data.w") -> tuple[int, int]:
    """The (H, W) pixel frame that the VQ turns into an h x w token grid (`what` names where h, w come from)."""
    if h < 1 or w < 1:
        raise ValueError(f"{what} = {h}, {w}: the token grid must be at least 1 x 1")
    ds = downsample(vq_or_arch)
    return h * ds, w * ds


def check_frame_size(vq_or_arch, size, what: str) -> tuple[int, int]:
    """(H, W) -> itself when the VQ's downsampling divides it, else a ValueError naming `what` (the config field)."""
    H, W = (int(v) for v in size)
    ds = downsample(vq_or_arch)
    if H % ds or W % ds or H < ds or W < ds:
        raise ValueError(f"{what} = {H}x{W} does not fit the VQ, which downsamples x{ds} "
                         f"(2 ** (len(vq.arch.block_out_channels) - 1)): use multiples of {ds}")
    return H, W


@torch.no_grad()
def encode_tokens(vq: VQModel, frames_u8: torch.Tensor) -> torch.Tensor:
    """(B, H, W, 3) uint8 -> (B, H/ds, W/ds) long token ids, ds = downsample(vq)."""
    x = to_input(frames_u8)
    ids = vq.quantize(vq.encode(x).latents)[2][2]  # (B*h*w,)
    ds = downsample(vq)
    return ids.view(x.shape[0], x.shape[2] // ds, x.shape[3] // ds)


@torch.no_grad()
def decode_tokens(vq: VQModel, ids: torch.Tensor) -> torch.Tensor:
    """(B, h, w) token ids -> (B, 3, ds*h, ds*w) in [-1, 1]."""
    B, h, w = ids.shape
    z = vq.quantize.get_codebook_entry(ids.reshape(-1), (B, h, w, vq.quantize.vq_embed_dim))
    return decode_latents(vq, z)


def decode_latents(vq: VQModel, z_q: torch.Tensor) -> torch.Tensor:
    """(B, D, h, w) quantised latents -> (B, 3, ds*h, ds*w). VQModel.decode without its lookup branches (aMUSEd's
    `lookup_from_codebook` would read z_q as ids)."""
    spatial = z_q if vq.config.norm_type == "spatial" else None
    return vq.decoder(vq.post_quant_conv(z_q), spatial)


def vq_id(path: str | Path | None = None) -> str:
    """A short identity of a VQ's weights (file name + sha256 prefix): token folders made with it record it."""
    import hashlib

    path = Path(path) if path else SMALL_WEIGHTS
    weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    if not weights:
        raise FileNotFoundError(f"no VQ weights (*.safetensors) in {path}")
    digest = hashlib.sha256(weights[0].read_bytes()).hexdigest()[:12]
    return f"{path.name}@{digest}"


VQ_DONE = "done.json"  # written when a VQ training reached its steps: a folder without it holds an unfinished VQ


def vq_finished(out: str | Path) -> bool:
    """Whether the VQ training into `out` finished (its best/ alone is written at the first validation)."""
    return (Path(out) / VQ_DONE).is_file() and (Path(out) / "best" / "config.json").is_file()
