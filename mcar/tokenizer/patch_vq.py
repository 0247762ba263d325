"""A VQ without a network: each p x p pixel patch of a frame becomes the id of the nearest of K codebook patches.

The codebook is k-means over training patches (`fit_patch_vq`, a minute on a CPU), or (fixed=) a listed set of patches
that each get an exact code, k-means fitting the rest: the committed vq_crafter_tiles holds every tile Crafter can
draw (mcar.crafter.textures). A token depends on its own patch only, so a scene shifted by whole patches gives
a token grid shifted exactly: Crafter rendered with one 16 x 16 tile per token (`data=crafter_tiles`:
data.view=[24,14] at 384x224) turns a move into a one-token shift, which a conv VQ (whose every token sees its
neighbours) does not guarantee.

It has the parts of a diffusers `VQModel` that mcar uses (`encode(x).latents`, `quantize`, `post_quant_conv`,
`decoder`, `config`), so tokenising, decoding, the IDM's code vectors and `vq_eval` take it unchanged; it is
saved as a folder (config.json with `_class_name: PatchVQ` + safetensors) that `load_vq` recognises.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.vae import VectorQuantizer
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from mcar.atomic import write_atomic, written_atomically

CLASS_NAME = "PatchVQ"
WEIGHTS = "diffusion_pytorch_model.safetensors"  # the name vq_id hashes, as for a VQModel folder


class _Unpatchify(torch.nn.Module):
    """(B, 3 p p, h, w) patch vectors -> (B, 3, p h, p w) pixels (VQModel.decoder's call signature)."""

    def __init__(self, patch: int):
        super().__init__()
        self.patch = patch

    def forward(self, z: torch.Tensor, spatial=None) -> torch.Tensor:
        return F.pixel_shuffle(z, self.patch)


class PatchVQ(torch.nn.Module):
    def __init__(self, patch: int = 16, num_vq_embeddings: int = 512, in_channels: int = 3):
        super().__init__()
        dim = in_channels * patch * patch
        self.config = SimpleNamespace(_class_name=CLASS_NAME, patch=patch, num_vq_embeddings=num_vq_embeddings,
                                      in_channels=in_channels, vq_embed_dim=dim, norm_type="group")
        self.quantize = VectorQuantizer(num_vq_embeddings, dim, beta=0.25, legacy=True)  # Euclidean nearest code
        self.post_quant_conv = torch.nn.Identity()
        self.decoder = _Unpatchify(patch)

    @property
    def patch(self) -> int:
        return self.config.patch

    @property
    def device(self) -> torch.device:
        return self.quantize.embedding.weight.device

    def encode(self, x: torch.Tensor) -> SimpleNamespace:
        """(B, C, H, W) in [-1, 1] -> .latents (B, C p p, H/p, W/p): each patch flattened (pixel_unshuffle order)."""
        return SimpleNamespace(latents=F.pixel_unshuffle(x, self.patch))

    def save_pretrained(self, path: str | Path, **_) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = {k: v for k, v in vars(self.config).items() if k != "vq_embed_dim"}
        write_atomic(path / "config.json", json.dumps(cfg, indent=1) + "\n")
        with written_atomically(path / WEIGHTS) as tmp:
            save_file({"codebook": self.quantize.embedding.weight.detach().contiguous().cpu()}, str(tmp))

    @classmethod
    def from_pretrained(cls, path: str | Path, **_) -> "PatchVQ":
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        vq = cls(int(cfg["patch"]), int(cfg["num_vq_embeddings"]), int(cfg.get("in_channels", 3)))
        try:
            codebook = load_file(str(path / WEIGHTS))["codebook"].float()
        except (SafetensorError, KeyError) as e:  # truncated, not safetensors, or no codebook in it
            raise ValueError(f"{path / WEIGHTS} is not a patch VQ's safetensors file ({type(e).__name__}: {e}); "
                             f"save the VQ again (mcar vq_patches) or point vq.path at a whole folder") from None
        if codebook.shape != vq.quantize.embedding.weight.shape:
            raise ValueError(f"{path / WEIGHTS}: codebook {tuple(codebook.shape)} does not match config.json "
                             f"({vq.config.num_vq_embeddings} codes of {vq.config.vq_embed_dim})")
        vq.quantize.embedding.weight.data.copy_(codebook)
        return vq.eval()


def is_patch_vq_folder(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    if not cfg.exists():
        return False
    try:
        return json.loads(cfg.read_text()).get("_class_name") == CLASS_NAME
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{cfg} is not a VQ config (a JSON object): {e}") from None


def nearest(x: torch.Tensor, codes: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """Index of the nearest row of `codes` (K, D) for every row of x (N, D), in chunks (Euclidean)."""
    c2 = (codes * codes).sum(1)
    return torch.cat([(c2 - 2 * xc @ codes.t()).argmin(1) for xc in x.split(chunk)])


HALF_LEVEL = 0.5 / 127.5  # half a grey level in [-1, 1]: patches closer than this in every value are the same pixels


def patch_vectors(patches: torch.Tensor) -> torch.Tensor:
    """(N, p, p, C) uint8 patches -> (N, C p p) in [-1, 1], in the order `PatchVQ.encode` flattens a patch."""
    x = patches.permute(0, 3, 1, 2).float().div(127.5).sub(1)
    return F.pixel_unshuffle(x, patches.shape[1]).flatten(1)


def same_pixels(x: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (index of the nearest row of `codes` for each row of x, whether it has x's pixels: every value within half
    a grey level)."""
    idx = nearest(x, codes)
    return idx, (x - codes[idx]).abs().amax(1) < HALF_LEVEL


def code_map(src, dst) -> tuple[torch.Tensor, torch.Tensor]:
    """For each code of the patch VQ `dst`: the code of `src` that `src` gives its pixels (the nearest, the first of
    equals, as tokenising does), and whether it holds exactly those pixels. A `dst` code that repeats an earlier
    one's pixels (a pad, never chosen) counts as not exact. -> (map (K_dst,) long, exact (K_dst,) bool). A model
    trained on `src` tokens starts a model of `dst` tokens from it (finetune.py retoken=true)."""
    for name, vq in (("src", src), ("dst", dst)):
        if not isinstance(vq, PatchVQ):
            raise ValueError(f"code_map: the {name} VQ is a {type(vq).__name__}; only patch VQs decode each code to "
                             f"its own pixels")
    if (src.patch, src.config.in_channels) != (dst.patch, dst.config.in_channels):
        raise ValueError(f"code_map: patches of {src.patch} px x {src.config.in_channels} channels against "
                         f"{dst.patch} x {dst.config.in_channels}: the VQs do not cut frames alike")
    d, s = (vq.quantize.embedding.weight.detach().float() for vq in (dst, src))
    codes, exact = same_pixels(d, s)
    return codes, exact & (nearest(d, d) == torch.arange(len(d)))


def _kmeans(x: torch.Tensor, k: int, iters: int, g: torch.Generator, max_seed_pool: int) -> torch.Tensor:
    """k centres for the rows of x (k-means++ seeding on a sample of its distinct rows, Lloyd iterations); empty
    clusters are re-seeded with the rows farthest from their centre. k <= the number of distinct rows."""
    distinct = torch.unique((x * 16).round(), dim=0) / 16
    if len(distinct) > max_seed_pool:
        distinct = distinct[torch.randperm(len(distinct), generator=g)[:max_seed_pool]]
    # k-means++ seeding on (a sample of) the distinct patches: common textures do not take every seed
    c = distinct[torch.randint(len(distinct), (1,), generator=g)]
    d2 = ((distinct - c) ** 2).sum(1)
    seeds = [c[0]]
    for _ in range(k - 1):
        i = torch.multinomial(d2.clamp_min(0) + 1e-12, 1, generator=g)
        seeds.append(distinct[i[0]])
        d2 = torch.minimum(d2, ((distinct - distinct[i]) ** 2).sum(1))
    centres = torch.stack(seeds)
    for _ in range(iters):
        idx = nearest(x, centres)
        sums = torch.zeros_like(centres).index_add_(0, idx, x)
        counts = torch.bincount(idx, minlength=k).float()
        empty = counts == 0
        centres = torch.where(empty[:, None], centres, sums / counts.clamp_min(1)[:, None])
        if empty.any():  # re-seed empty codes with the worst-fitted patches
            err = ((x - centres[idx]) ** 2).sum(1)
            centres[empty] = x[err.topk(int(empty.sum())).indices]
    return centres


@torch.no_grad()
def fit_patch_vq(frames: torch.Tensor, patch: int = 16, codes: int = 256, iters: int = 15, seed: int = 0,
                 max_patches: int = 100_000, max_seed_pool: int = 20_000, fixed: torch.Tensor | None = None,
                 keep: torch.Tensor | None = None) -> tuple[PatchVQ, dict]:
    """k-means (k-means++ seeding on a sample, Lloyd iterations) over the p x p patches of `frames`
    (N, H, W, 3) uint8. -> (the VQ, {patches, distinct, codes_used, mse, ...}). Empty clusters are re-seeded with the
    patches farthest from their code, so every code ends up in use when there are enough distinct patches.

    fixed: (F, p, p, 3) uint8 patches, all different, that each get a code of their own holding exactly their pixels
    (every tile a game can draw: mcar.crafter.textures), whether or not the frames show them; k-means then
    fits the codes left over on the patches of `frames` that are none of them (none, when `fixed` is every tile the
    frames can hold). keep: a previous codebook (K0, C p p): a fixed patch that is one of its codes keeps that
    code's id, so tokens made with it stay valid; its other codes are not kept. Codes left over repeat the first
    code, never chosen."""
    g = torch.Generator().manual_seed(seed)
    x = _sample_patches(frames, patch, max_patches, g)
    n_distinct = len(torch.unique((x * 16).round(), dim=0))
    stats: dict = {}
    book = torch.zeros(codes, x.shape[1])
    taken = torch.zeros(codes, dtype=torch.bool)
    rest = x if fixed is None else _place_fixed(fixed, keep, patch, x, book, taken, stats)
    k = min(int((~taken).sum()), len(torch.unique((rest * 16).round(), dim=0))) if len(rest) else 0
    if k:
        book[(~taken).nonzero()[:k, 0]] = _kmeans(rest, k, iters, g, max_seed_pool)
        taken[(~taken).nonzero()[:k, 0]] = True
    _pad_unused_codes(book, taken)
    idx = nearest(x, book)
    mse = float(((x - book[idx]) ** 2).mean())
    vq = PatchVQ(patch, codes, frames.shape[-1])
    vq.quantize.embedding.weight.data.copy_(book)
    return vq.eval(), {"patches": len(x), "distinct": n_distinct, "codes_used": int(idx.unique().numel()),
                       "mse": mse, **stats}


def _sample_patches(frames: torch.Tensor, patch: int, max_patches: int, g: torch.Generator) -> torch.Tensor:
    """-> (P, D) patch vectors in [-1, 1], at most max_patches drawn at random (sampled while uint8: frames can be
    many)."""
    x = F.pixel_unshuffle(frames.permute(0, 3, 1, 2), patch)  # (N, D, h, w)
    x = x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])
    if len(x) > max_patches:
        x = x[torch.randperm(len(x), generator=g)[:max_patches]]
    return x.float().div(127.5).sub(1)


def _place_fixed(fixed: torch.Tensor, keep: torch.Tensor | None, patch: int, x: torch.Tensor, book: torch.Tensor,
                 taken: torch.Tensor, stats: dict) -> torch.Tensor:
    """Writes each fixed patch into a code of `book` of its own (its kept id when `keep` holds it), marks it in
    `taken` and notes counts in `stats`. -> the patches of `x` that are none of the fixed ones."""
    codes = len(book)
    if fixed.shape[1:3] != (patch, patch):
        raise ValueError(f"fixed patches of {tuple(fixed.shape[1:3])} pixels, the VQ's patch is {patch}")
    fx = patch_vectors(fixed)
    if len(torch.unique(fixed.flatten(1), dim=0)) < len(fixed):
        raise ValueError("two fixed patches have the same pixels: they cannot have a code each")
    if len(fx) > codes:
        raise ValueError(f"{len(fx)} fixed patches do not fit codes={codes}")
    ids = torch.full((len(fx),), -1)
    if keep is not None:
        ki, match = same_pixels(fx, keep.float())
        if (ki[match] >= codes).any():
            raise ValueError(f"keep: a fixed patch is code {int(ki[match].max())} of the kept codebook, past "
                             f"codes={codes}")
        ids[match] = ki[match]
        stats["kept_ids"] = int(match.sum())
    free = [i for i in range(codes) if i not in set(ids.tolist())]
    ids[ids < 0] = torch.tensor(free[:int((ids < 0).sum())], dtype=ids.dtype)
    book[ids], taken[ids] = fx, True
    _, known = same_pixels(x, fx)
    rest = x[~known]
    stats.update(fixed=len(fx), patches_not_fixed=len(rest))
    return rest


def _pad_unused_codes(book: torch.Tensor, taken: torch.Tensor) -> None:
    """Fewer distinct patches than codes: the rest repeat the first code (never chosen: the nearest code is the
    first of equals); one before it (keep left code 0 free) holds a vector far outside [-1, 1], never nearest
    either."""
    first = int(taken.nonzero()[0, 0]) if taken.any() else 0
    pads = (~taken).nonzero()[:, 0]
    book[pads] = torch.where((pads > first)[:, None], book[first], torch.full_like(book[first], 5.0))
