"""A LLaMA-style decoder with 3D RoPE: pre-norm RMSNorm, SwiGLU, no biases, optional GQA, untied embeddings.

Two ways to run it:
- parallel (training, one-pass parity forward): `model(tokens, coords, mask)` with `mask` a dense boolean
  (S, S) tensor (SDPA; the CPU path, which has a backward) or a flex-attention BlockMask (the GPU path);
- cached (samplers): after `model.setup_cache(batch, n_slots)`, `model(tokens, coords, mask, cache_pos)`
  feeds the given inputs, attends to the static KV cache plus the pass's own inputs, and then writes each
  input's key/value at its slot `cache_pos` (gpt-fast style: a static cache written by index).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from mcar.rope import RoPE3D, apply_rope


@dataclass
class ModelConfig:
    vocab_size: int
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None -> n_heads (no GQA)
    mlp_dim: int = 1024
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    init_std: float = 0.02

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        checks = {
            "vocab_size": self.vocab_size > 0,
            "dim": self.dim > 0 and self.dim % self.n_heads == 0,
            "n_layers": self.n_layers > 0,
            "n_kv_heads": self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads == 0,
            "mlp_dim": self.mlp_dim > 0,
        }
        for field, ok in checks.items():
            if not ok:
                raise ValueError(
                    f"model.{field}={getattr(self, field)} is invalid (dim must divide by n_heads, "
                    f"n_heads by n_kv_heads; all sizes > 0): dim={self.dim}, n_heads={self.n_heads}, "
                    f"n_kv_heads={self.n_kv_heads}"
                )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# flex_attention is only fast when compiled; compile lazily so CPU users never pay for it.
_flex_compiled = None


def _flex(q, k, v, block_mask):
    global _flex_compiled
    if q.is_cuda:
        if _flex_compiled is None:
            _flex_compiled = torch.compile(flex_attention, dynamic=False)
        return _flex_compiled(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


class KVCache(nn.Module):
    """Static per-layer cache (B, n_kv_heads, n_slots, head_dim), written by slot index."""

    def __init__(self, batch: int, n_kv_heads: int, n_slots: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, n_kv_heads, n_slots, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """pos (S,) slot indices; k, v (B, n_kv, S, D)."""
        self.k.index_copy_(2, pos, k.to(self.k.dtype))
        self.v.index_copy_(2, pos, v.to(self.v.dtype))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.cache: KVCache | None = None

    def forward(self, x, cos, sin, mask, cache_pos=None):
        B, S, _ = x.shape  # (B, S, C)
        q, k, v = self.wqkv(x).split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], -1)
        q = q.view(B, S, self.n_heads, self.hd).transpose(1, 2)  # (B, H, S, D)
        k = k.view(B, S, self.n_kv, self.hd).transpose(1, 2)  # (B, Hkv, S, D)
        v = v.view(B, S, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache_pos is not None:
            y = self._cached(q, k, v, mask, cache_pos)
        elif isinstance(mask, BlockMask):
            y = _flex(q, k, v, mask)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_kv != self.n_heads
            )
        return self.wo(y.transpose(1, 2).reshape(B, S, -1))

    def _cached(self, q, k, v, mask, cache_pos):
        """Attend to [the first n cache slots | this pass's inputs] under `mask` (B|1, S, n + S), then write.

        n = mask width - S <= n_slots: a caller may pass only the cache prefix its queries can see (a view of
        the cache, no copy). Written after attending, so the cache columns only ever show slots of earlier
        passes. Unwritten slots hold zeros (the cache is zeroed before its first cached forward, see
        `Transformer.reset_cache`), so a masked column adds exactly 0 to the output: no per-pass V hygiene copy.
        """
        if self.cache is None:
            raise RuntimeError("cached forward needs model.setup_cache(batch, n_slots) first")
        B, H, S, D = q.shape
        g, n = H // self.n_kv, mask.shape[-1] - S
        ck, cv = self.cache.k[:, :, :n], self.cache.v[:, :, :n]  # (B, Hkv, n, D) views
        qg = (q * (1.0 / math.sqrt(D))).reshape(B, self.n_kv, g * S, D).to(ck.dtype)  # GQA group folded into rows
        k, v = k.to(ck.dtype), v.to(ck.dtype)
        scores = torch.cat([qg @ ck.transpose(-1, -2), qg @ k.transpose(-1, -2)], dim=-1)  # (B, Hkv, g*S, n+S)
        m = mask.reshape(-1, 1, 1, S, n + S)  # (B|1, 1, 1, S, n+S)
        scores = scores.view(B, self.n_kv, g, S, n + S).float().masked_fill(~m, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(ck.dtype).view(B, self.n_kv, g * S, n + S)
        y = p[..., :n] @ cv + p[..., n:] @ v  # (B, Hkv, g*S, D)
        self.cache.write(cache_pos, k, v)
        return y.view(B, H, S, D).type_as(q)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.mlp_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.mlp_dim, bias=False)
        self.w2 = nn.Linear(cfg.mlp_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, mask, cache_pos=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache_pos)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rope = RoPE3D(cfg.head_dim, cfg.rope_base)
        self._cache_unused = False  # True from setup_cache until the first cached forward zeroes the cache
        self.reset_parameters()

    def reset_parameters(self):
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            # residual-branch outputs scaled down with depth (GPT-2 / LLaMA practice)
            s = std / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else std
            nn.init.normal_(p, 0.0, s)

    def num_params(self, embeddings: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n if embeddings else n - self.tok_embeddings.weight.numel()

    def setup_cache(self, batch: int, n_slots: int, dtype=None, device=None) -> None:
        """Allocate a zeroed static KV cache of `n_slots` slots per layer."""
        p = self.output.weight
        for layer in self.layers:
            layer.attention.cache = KVCache(
                batch, self.cfg.n_kv_heads, n_slots, self.cfg.head_dim, dtype or p.dtype, device or p.device
            )
        self._cache_unused = True  # zeroed again at the first cached forward (see reset_cache)

    def reset_cache(self) -> None:
        """Zero every slot in place (one memset per sequence, before the loop): an unwritten slot then holds 0
        and a masked column adds exactly 0, even where earlier code left NaN or inf in the cache."""
        for layer in self.layers:
            layer.attention.cache.k.zero_()
            layer.attention.cache.v.zero_()
        self._cache_unused = False

    def clear_cache(self) -> None:
        for layer in self.layers:
            layer.attention.cache = None

    def forward(
        self,
        tokens: torch.Tensor,
        coords: torch.Tensor,
        mask: torch.Tensor | BlockMask | None = None,
        cache_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, S) long; coords (S, 3) or (B, S, 3) long; returns logits (B, S, vocab) float32.

        mask: None (plain causal), dense bool (S, S) / (B, 1, S, S), or a BlockMask; in cached mode
        (cache_pos (S,) given) a bool (S, n + S) or (B|1, S, n + S) over [the first n <= n_slots cache slots |
        this pass's inputs].
        """
        if cache_pos is not None and self._cache_unused:
            self.reset_cache()  # first cached forward since setup_cache: anything written meanwhile is not ours
        cos, sin = self.rope(coords)  # (S, D/2) or (B, S, D/2)
        if cos.dim() == 2:
            cos, sin = cos[None], sin[None]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B|1, 1, S, D/2)
        x = self.tok_embeddings(tokens)  # (B, S, C)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache_pos)
        return self.output(self.norm(x)).float()
