"""The inverse-dynamics model (IDM): two consecutive frames' VQ tokens -> the action taken between them.

MineWorld scores action following with VPT's IDM; we train our own on the same dataset as the world model, on
VQ tokens read as the VQ's frozen code vectors (so generated clips are scored without decoding, and two codes
for one texture look alike), and report its held-out accuracy so the score can be trusted. Train it:

    mcar idm data=crafter                 # -> checkpoints/idm-crafter/idm.pt + metrics.json
    mcar idm data=crafter steps=1000 hidden=32   # + a CNN

Frame t's action a[t] is taken after seeing frame t and leads to frame t+1 (the layout of docs/diagd.md), so the
IDM reads (frame t, frame t+1) and predicts the n_a action tokens a[t] (local ids, before the codebook offset).
The action-following score (`action_scores`) is per-action precision / recall / F1 of its predictions on
generated frame pairs against the conditioning actions, as MineWorld reports.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from mcar.atomic import written_atomically
from mcar.checkpoint.io import load_weights_only


def random_codebook(codebook_size: int, code_dim: int, seed: int = 0) -> torch.Tensor:
    """A fixed seeded unit-norm codebook (K, D): the code vectors of data that has no VQ (synthetic data, tests)."""
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(codebook_size, code_dim, generator=g), dim=-1)


def vq_codebook(vq, max_dim: int = 32) -> torch.Tensor:
    """A VQ's code vectors (K, D), l2-normalised (the committed VQs' lookup is on the unit sphere). Wider codes (a
    patch VQ's are 768 raw pixels) are centred and cut to their `max_dim` principal components first: the
    correlation volume holds D x 63 numbers per position, 4 GB a batch at D = 768."""
    codes = vq.quantize.embedding.weight.detach().float().cpu()
    if codes.shape[1] > max_dim:
        centred = codes - codes.mean(0)
        codes = centred @ torch.linalg.svd(centred, full_matrices=False).Vh[:max_dim].t()
    return F.normalize(codes, dim=-1)


class InverseDynamics(nn.Module):
    """Frozen VQ code vectors of both frames -> [e_t, e_t+1, e_t+1 - e_t, local correlation volume] -> CNN -> heads.

    The token ids are looked up in the VQ's codebook (a frozen buffer `codebook` (K, D), saved with the IDM, so
    evaluation sees the same vectors): synonyms (two codes for one texture) get near vectors, and nothing per id is
    learned, which overfit on the ~1k pairs of a small dataset. The correlation volume holds, for every shift
    (dy, dx) within +-max_shift tokens, the cosine of e_t+1(y, x) with e_t(y + dy, x + dx), and its softmax over
    the shifts (`temperature`): each position's vote for where its content came from. A whole-view shift (Crafter
    moves the view one tile, 1.5 x 2.6 tokens) lights up one shift wherever the view is not uniform. The head
    reads the CNN's mean and max over the grid, a coarse pooled grid (where things changed: the player is in the
    centre) and the correlation and votes pooled by a learned attention over positions (content and coordinates:
    it learns to skip Crafter's inventory rows, whose changes are not motion), standardised.
    """

    def __init__(self, codebook_size: int, n_a: int, action_vocab_size: int, dim: int = 8, hidden: int = 64,
                 max_shift: tuple = (3, 4), grid: tuple = (3, 3), dropout: float = 0.1, temperature: float = 20.0,
                 codebook: torch.Tensor | None = None):
        super().__init__()
        cbk = random_codebook(codebook_size, dim) if codebook is None else codebook.detach().float().cpu()
        if cbk.shape[0] != codebook_size:
            raise ValueError(f"the codebook has {cbk.shape[0]} codes, not codebook_size={codebook_size}")
        dim = cbk.shape[1]  # the code width (the VQ's vq_embed_dim)
        self.config = dict(codebook_size=codebook_size, n_a=n_a, action_vocab_size=action_vocab_size, dim=dim,
                           hidden=hidden, max_shift=tuple(max_shift), grid=tuple(grid), dropout=dropout,
                           temperature=temperature)
        self.n_a, self.action_vocab_size = n_a, action_vocab_size
        self.max_shift, self.grid, self.temperature = tuple(max_shift), tuple(grid), temperature
        self.register_buffer("codebook", cbk)  # frozen: not a parameter, saved in the state dict
        n_shift = (2 * self.max_shift[0] + 1) * (2 * self.max_shift[1] + 1)
        self.cnn = nn.Identity() if not hidden else nn.Sequential(
            nn.Conv2d(3 * dim + 2 * n_shift, hidden, 1), nn.GELU(),
            nn.Conv2d(hidden, hidden, 3, padding=1), nn.GELU(),
            nn.Conv2d(hidden, hidden, 3, stride=2, padding=1), nn.GELU(),
        )
        self.drop = nn.Dropout(dropout)
        self.attend = nn.Conv2d(3 * dim + 2 * n_shift + 2, 1, 1)  # where to pool the votes (content + position)
        nn.init.zeros_(self.attend.weight), nn.init.zeros_(self.attend.bias)  # starts as the plain mean
        self.norm = nn.BatchNorm1d(2 * n_shift)  # the pooled correlation and votes, standardised
        self.head = nn.Linear(hidden * (2 + grid[0] * grid[1]) + 2 * n_shift, n_a * action_vocab_size)  # hidden 0:
        # no CNN, the head reads the pooled votes only

    def correlation(self, ea: torch.Tensor, eb: torch.Tensor) -> torch.Tensor:
        """(B, D, h, w) x 2 -> (B, n_shift, h, w): eb(y, x) . ea(y + dy, x + dx), zero outside the frame."""
        (sy, sx), (B, D, h, w) = self.max_shift, ea.shape
        win = F.unfold(ea, (2 * sy + 1, 2 * sx + 1), padding=(sy, sx)).view(B, D, -1, h * w)  # (B, D, n_shift, hw)
        return torch.einsum("bdsn,bdn->bsn", win, eb.flatten(2)).view(B, -1, h, w)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a, b (B, h, w) token ids of frames t and t+1 -> logits (B, n_a, action_vocab_size)."""
        ea = rearrange(self.codebook[a], "b h w d -> b d h w")
        eb = rearrange(self.codebook[b], "b h w d -> b d h w")
        corr = self.correlation(ea, eb)
        votes = torch.softmax(self.temperature * corr, 1)  # where each position's content came from
        feats = torch.cat([ea, eb, eb - ea, corr, votes], 1)
        B, _, h, w = feats.shape
        yx = torch.stack(torch.meshgrid(torch.linspace(-1, 1, h), torch.linspace(-1, 1, w), indexing="ij"))
        att = torch.softmax(self.attend(torch.cat([feats, yx.expand(B, 2, h, w)], 1)).flatten(1), 1)  # (B, hw)
        pooled = self.norm(torch.einsum("bcn,bn->bc", torch.cat([corr, votes], 1).flatten(2), att))
        if self.config["hidden"]:
            x = self.cnn(feats)  # (B, hidden, h/2, w/2)
            pooled = torch.cat([x.mean((2, 3)), x.amax((2, 3)), F.adaptive_avg_pool2d(x, self.grid).flatten(1),
                                pooled], 1)
        x = pooled
        return rearrange(self.head(self.drop(x)), "b (slot v) -> b slot v", slot=self.n_a)

    @torch.no_grad()
    def predict(self, a: torch.Tensor, b: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
        """-> (B, n_a) predicted local action ids."""
        return torch.cat([self(x, y).argmax(-1) for x, y in zip(a.split(batch_size), b.split(batch_size))])


def save_idm(model: InverseDynamics, path: Path, meta: dict) -> None:
    with written_atomically(path) as tmp:
        torch.save({"config": model.config, "state_dict": model.state_dict(), "meta": meta}, tmp)


class StaleIDM(ValueError):
    """An IDM file of before 2026-11-22 (learned token-id embeddings, no VQ codebook): retrain it."""


def read_idm(path: str | Path) -> InverseDynamics:
    """The IDM saved by `save_idm` at `path`, loaded weights only (a file holding more is refused: ValueError;
    StaleIDM for the token-id IDM of before 2026-11-22)."""
    ckpt = load_weights_only(path, "inverse-dynamics model")
    if "codebook" not in ckpt["state_dict"]:
        raise StaleIDM(f"{path} is an old token-id IDM (no VQ codebook in it): retrain it (mcar idm)")
    model = InverseDynamics(**ckpt["config"], codebook=ckpt["state_dict"]["codebook"])
    model.load_state_dict(ckpt["state_dict"])
    model.meta = ckpt.get("meta", {})
    return model.eval()


def tokens_name(datamodule) -> str | None:
    """The token folder a data module reads (it names the VQ): an IDM only fits tokens of the VQ it saw."""
    if getattr(datamodule, "tokens_name", None):  # shipped held-out clips: the folder they were copied from
        return datamodule.tokens_name
    try:
        return Path(datamodule.tokens_dir).name
    except (AttributeError, NotImplementedError):
        return None
