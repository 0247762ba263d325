"""A LLaMA-style decoder with 3D RoPE (or 1D, `rope`): pre-norm RMSNorm, SwiGLU, no biases, optional GQA, untied
embeddings.

Two ways to run it:
- parallel (training, one-pass parity forward): `model(tokens, coords, mask)` with `mask` a dense boolean
  (S, S) tensor (SDPA; the CPU path, which has a backward) or a flex-attention BlockMask (the GPU path);
- cached (samplers): after `model.setup_cache(batch, n_slots)`, `model(tokens, coords, mask, cache_pos)`
  feeds the given inputs, writes each input's key/value at its slot `cache_pos` (gpt-fast style: a static cache
  written by index) and attends to the static KV cache plus the pass's own inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from mcar.core.precision import active_dtype
from mcar.core.rope import ROPES, rotate, rotation_tables


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
    rope: str = "3d"  # 3d: (time, row, col) axes; 1d: LLaMA's over the flat position (MineWorld)
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
            "rope": self.rope in ROPES,
        }
        for field, ok in checks.items():
            if not ok:
                raise ValueError(
                    f"model.{field}={getattr(self, field)} is invalid (dim must divide by n_heads, n_heads by "
                    f"n_kv_heads; all sizes > 0; rope one of {sorted(ROPES)}): dim={self.dim}, "
                    f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}"
                )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def _wants_compiled_flex(q: torch.Tensor) -> bool:
    """flex_attention is only fast compiled: on CUDA (CPU users never pay for compiling it)."""
    return q.is_cuda


_flex_compiled = None  # torch.compile(flex_attention), made at the first eager call that wants it
# The H100 forward template at the 700m shapes (head_dim 64, bf16) with flex's default 4 warps / 3 stages used all
# 255 registers, spilled and serialized its wgmma pipeline (ptxas C7511); 8 warps / 2 stages keep the 128 x 128
# tiles with no spill in the forward or the backward (BENCHMARKS.md, "GPU kernels compiled on CPU").
FLEX_KERNEL_OPTIONS = {"num_warps": 8, "num_stages": 2}
_flex_options = dict(FLEX_KERNEL_OPTIONS)  # what CUDA flex calls pass (set_flex_kernel_options)


def set_flex_kernel_options(options: dict | None) -> None:
    """flex_attention's kernel options on CUDA for this process: FLEX_KERNEL_OPTIONS updated by `options` (a run's
    mask.flex_kernel_options, e.g. {USE_TMA: true}: TMA loads on Hopper); None: the defaults."""
    _flex_options.clear()
    _flex_options.update(FLEX_KERNEL_OPTIONS | dict(options or {}))


# The cached passes' attention, chosen here rather than by SDPA's dispatcher at trace time (which picked cuDNN under
# the H100 emulation): on CUDA the memory-efficient kernel, the one the per-pass plan assumes (arbitrary bias, few
# query rows; flash takes no bias), on CPU the fused flash kernel; math only where neither applies.
CACHED_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def _flex(q, k, v, block_mask):
    """flex_attention, compiled when called eagerly on CUDA. Inside a compiled region (per-block compile) it is
    traced as is, and that region compiles it: creating the compiled wrapper there would write a global inside the
    traced code, which dynamo cannot do under activation checkpointing (a graph break that left every block
    eager)."""
    global _flex_compiled
    gqa = q.shape[1] != k.shape[1]
    options = dict(_flex_options) if q.is_cuda else None
    if _wants_compiled_flex(q) and not torch.compiler.is_compiling():
        if _flex_compiled is None:
            _flex_compiled = torch.compile(flex_attention, dynamic=False)
        return _flex_compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa, kernel_options=options)
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa, kernel_options=options)


# Split-KV's slices are all one width, the pass's width over their number rounded up to a multiple of this many key
# columns (they end past the pass's keys, masked, rather than the last one narrower): each slice's bias rows are then
# aligned for the CUDA memory-efficient kernel (it pads, i.e. copies, a bias whose rows are not), and nothing depends
# on a width's remainder, so a compiled step traced once holds for every width (no guard failing from pass to pass).
SPLIT_ALIGN = 16
MAX_KV_SPLITS = 8  # what ScheduleSampler.kv_splits_for picks at most; more still works, copying the keys per layer
SPLIT_TAIL = SPLIT_ALIGN * MAX_KV_SPLITS  # KVCache rows after the slots: room for the slices' rounded-up ends


class KVCache(nn.Module):
    """Static per-layer cache, written by slot index: `k`, `v` (B, n_kv_heads, n_slots, head_dim).

    Both are views into one buffer whose first `staging` rows take each pass's own keys/values, right before
    slot 0: [this pass's inputs | cache prefix] is then one contiguous view, so attention reads the visible
    cache in place (no per-pass concatenation, which would copy the whole visible cache in every layer). After
    the slots, `SPLIT_TAIL` rows never written (zeros): split-KV reads its slices' rounded-up ends there.
    """

    def __init__(self, batch: int, n_kv_heads: int, n_slots: int, head_dim: int, dtype, device,
                 staging: int = 128):
        super().__init__()
        self.staging, self.n_slots = staging, n_slots
        shape = (batch, n_kv_heads, staging + n_slots + SPLIT_TAIL, head_dim)
        self.register_buffer("k_buf", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_buf", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def select(self, rows: torch.Tensor, into: "KVCache | None" = None) -> "KVCache":
        """A cache holding copies of batch rows `rows` (a batch of games split: each row's keys exactly): `into`,
        written in place (a cache of len(rows) rows, otherwise this one's shape, at an address kept), or new."""
        if into is not None:
            torch.index_select(self.k_buf, 0, rows, out=into.k_buf)
            torch.index_select(self.v_buf, 0, rows, out=into.v_buf)
            return into
        out = KVCache.__new__(KVCache)
        nn.Module.__init__(out)
        out.staging, out.n_slots = self.staging, self.n_slots
        out.register_buffer("k_buf", self.k_buf[rows].clone(), persistent=False)
        out.register_buffer("v_buf", self.v_buf[rows].clone(), persistent=False)
        return out

    @property
    def k(self) -> torch.Tensor:
        return self.k_buf[:, :, self.staging:self.staging + self.n_slots]

    @property
    def v(self) -> torch.Tensor:
        return self.v_buf[:, :, self.staging:self.staging + self.n_slots]

    def write(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int,
              span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a pass's keys/values k, v (B, n_kv, S, D) at their slots `pos` (S,) and return what its queries
        attend to: [k | slots 0..n-1] and [v | slots 0..n-1], (B, n_kv, S + n, D); `span` (>= S + n, split-KV's)
        columns instead: what follows slot n-1 (later slots, the tail; zeros past the slots where copied), which
        the caller masks.

        Every write comes before any read, and each lands in the buffer itself (the staging rows right before
        slot 0, then the slots): compiled, inductor then writes the buffer in place. A write through a second
        view after the read made it copy the whole buffer several times per layer and pass. The views are exact
        as long as no slot the queries see among 0..n-1 is one this pass writes (slots are written once; the
        scratch slot is never seen)."""
        S, st = k.shape[2], self.staging
        span = S + n if span is None else span
        k, v = k.to(self.k_buf.dtype), v.to(self.v_buf.dtype)
        if n == 0 or S > st or st - S + span > self.k_buf.shape[2]:  # the prefill (nothing cached to see), a pass
            # wider than the staging rows, or slices reaching past the tail (more than MAX_KV_SPLITS): one copy
            self.k_buf[:, :, st + pos] = k
            self.v_buf[:, :, st + pos] = v
            if n == 0 and span == S:
                return k, v
            return _padded_keys(k, self.k[:, :, :n], span), _padded_keys(v, self.v[:, :, :n], span)
        if torch.compiler.is_compiling():  # one indexed write per buffer: what inductor writes in place
            rows = torch.cat([torch.arange(st - S, st, device=pos.device), st + pos])  # staging rows, then slots
            self.k_buf[:, :, rows] = torch.cat([k, k], 2)
            self.v_buf[:, :, rows] = torch.cat([v, v], 2)
        else:  # eager: the same values in the same places, in two writes per buffer (fewer small ops on CPU)
            self.k_buf[:, :, st + pos], self.k_buf[:, :, st - S:st] = k, k
            self.v_buf[:, :, st + pos], self.v_buf[:, :, st - S:st] = v, v
        return self.k_buf[:, :, st - S:st - S + span], self.v_buf[:, :, st - S:st - S + span]


def _padded_keys(own: torch.Tensor, cached: torch.Tensor, span: int) -> torch.Tensor:
    """[own | cached] along the keys, then zeros up to `span` columns: one fresh tensor."""
    parts = [own, cached]
    if span > own.shape[2] + cached.shape[2]:
        parts.append(own.new_zeros(*own.shape[:2], span - own.shape[2] - cached.shape[2], own.shape[3]))
    return torch.cat(parts, 2)


def cached_attention_bias(mask: torch.Tensor, groups: int, dtype) -> torch.Tensor:
    """The cached path's mask (B|1, S, n + S) over [cache prefix | own inputs], or (S, n + S) -> the additive bias
    (B|1, 1, groups * S, S + n) over [own inputs | cache prefix] (the KVCache.with_own order), 0 where visible and
    -inf elsewhere; query rows repeated per GQA group (query heads of one KV head folded into rows, so K/V are
    never repeated). Built once per forward for all layers. Rows are padded to a multiple of 16 columns: the
    CUDA memory-efficient kernel otherwise pads (copies) the bias in every layer. A caller may build it ahead
    (the static sampler does, once per pass of its plan) and pass it as the forward's mask."""
    return padded_attention_bias(mask, groups, dtype)[..., :mask.shape[-1]]


def padded_attention_bias(mask: torch.Tensor, groups: int, dtype) -> torch.Tensor:
    """`cached_attention_bias` with its padding columns: (B|1, 1, groups * S, width rounded up to 16)."""
    mask = mask.reshape(-1, *mask.shape[-2:])  # (B|1, S, n + S)
    Bm, S, width = mask.shape
    n = width - S
    padded = -(-width // 16) * 16
    bias = torch.full((Bm, 1, groups, S, padded), float("-inf"), dtype=dtype, device=mask.device)
    bias[..., :S].masked_fill_(mask[:, None, None, :, n:], 0.0)
    bias[..., S:width].masked_fill_(mask[:, None, None, :, :n], 0.0)
    return bias.view(Bm, 1, groups * S, padded)


class SplitKV(NamedTuple):
    """A cached pass's attention bias cut along the keys into `chunks` slices that one attention call takes as its
    heads (flash-decoding): a pass of a few query rows then keeps chunks x as many GPU blocks reading the cache, where
    one block per (row of the batch, KV head) leaves most of an H100's 132 SMs idle. Chunk c reads key columns
    [c * step, (c + 1) * step) of the pass's [own inputs | cache prefix | what follows], step = the width divided by
    the chunks, rounded up to SPLIT_ALIGN; the columns past the width are masked."""

    bias: torch.Tensor  # (B|1, chunks, rows, step): each chunk's columns of the additive bias
    live: torch.Tensor  # (B|1, chunks, rows) bool: the chunk shows the row at least one key
    width: int  # the uncut bias's width (own inputs + cache prefix)

    @property
    def span(self) -> int:
        """Key columns the chunks read: chunks x step (>= width)."""
        return self.bias.shape[1] * self.bias.shape[-1]


def split_bias(bias: torch.Tensor, chunks: int) -> SplitKV:
    """The forward's cached bias (B|1, 1, rows, width) -> its `chunks` slices (SplitKV), built once per forward for
    every layer. One gather of clamped columns, the ones past the width then masked: no op here depends on the
    width's value (a compiled step guards on none)."""
    width = bias.shape[-1]
    step = -(-width // (SPLIT_ALIGN * chunks)) * SPLIT_ALIGN
    cols = torch.arange(chunks * step, device=bias.device)
    sliced = bias[:, 0][..., cols.clamp(max=width - 1)].masked_fill(cols >= width, float("-inf"))
    sliced = sliced.unflatten(-1, (chunks, step)).transpose(1, 2).contiguous()  # (B|1, chunks, rows, step)
    return SplitKV(sliced, (sliced > float("-inf")).any(-1), width)


def _attention_with_lse(q, k, v, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention that also returns each row's log-sum-exp of scores (B, H, rows[, padded]): the kernels
    F.scaled_dot_product_attention picks on CUDA (memory-efficient) and CPU (flash), called directly for it."""
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias)
    return out, lse[..., :q.shape[-2]]


def split_kv_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, split: SplitKV) -> torch.Tensor:
    """Attention of q (B, Hkv, rows, D) over keys/values (B, Hkv, split.span, D) under `split`, equal to one SDPA
    call under the uncut bias up to rounding: each chunk's output weighted by its share of the row's softmax mass
    (exp of its log-sum-exp, 0 for a chunk that shows the row nothing). The chunks are views of the keys (the cache
    is read in place, not copied: its batch and head dimensions merge, its key columns split into chunks); the
    queries are repeated per chunk (a few rows)."""
    B, Hkv, R, D = q.shape
    bias, C = split.bias, split.bias.shape[1]
    wc = bias.shape[-1]
    qc = q.reshape(B * Hkv, 1, R, D).expand(B * Hkv, C, R, D).contiguous()
    bias = bias[:, None].expand(bias.shape[0], Hkv, C, R, wc)
    bias = bias.expand(B, Hkv, C, R, wc).reshape(B * Hkv, C, R, wc)  # a view when the bias is shared (B|1 = 1)
    out, lse = _attention_with_lse(qc, keys.view(B * Hkv, C, wc, D), values.view(B * Hkv, C, wc, D), bias)
    live = split.live[:, None].expand(B, Hkv, C, R).reshape(B * Hkv, C, R)
    acc = torch.promote_types(q.dtype, torch.float32)  # float64 stays float64 (exactness tests)
    lse = lse.to(acc).masked_fill(~live, float("-inf"))
    top = lse.amax(1, keepdim=True)
    w = torch.exp(lse - top.clamp(min=torch.finfo(acc).min))  # 0 where the chunk shows nothing
    y = torch.where(w[..., None] > 0, out.to(acc) * w[..., None], 0.0).sum(1) / w.sum(1).clamp(min=1e-30)[..., None]
    return y.to(q.dtype).view(B, Hkv, R, D)


# ---- small-row GEMMs on CPU: prepacked weights --------------------------------------------------------------
# A cached pass feeds a few rows (NTP 1, DiagD k=2 ~7). On a float32 CPU, MKL's sgemm (F.linear) with the weight
# (out, in) costs ~2.5x at 7 rows what it costs at 1, while oneDNN's inner product on the weight reordered once
# into its blocked layout costs ~1.7x MKL's 1-row time: `model=small`'s 33 linears, 1 thread, 2026-11-28 (a busy
# machine, shuffled runs): 4 rows 24.2 -> 19.0 ms, 7 rows 31.9 -> 21.9, 10 rows 39.4 -> 22.0, 13 rows 44.5 -> 24.7;
# at 1-3 rows MKL is faster (12.8 vs 16.5 at 1). It was what capped DiagD's speedup over NTP on CPU (BENCHMARKS.md,
# "DiagD vs NTP on CPU"): ~70% of a DiagD pass was aten::mm. Results agree with F.linear to float32 rounding, not
# bit for bit.
PACKED_ROWS = range(4, 65)  # rows (batch x inputs) of a pass that take the packed path: where it won (the prefill,
# hundreds of rows, stays on MKL: the two were level there)
_packed = WeakIdKeyDictionary()  # weight (by identity) -> (its data as packed, (address, version), packed copy)
_packing_ok = [hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()]


def _forget_packed(optimizer, args, kwargs) -> None:
    """After any optimizer step every packed copy is dropped: a fused step (AdamW's default here) writes the weights
    without bumping their version counter, so a model sampled during training (validation, post-training rollouts)
    would otherwise keep sampling the weights of its first sampled step."""
    _packed.clear()


register_optimizer_step_post_hook(_forget_packed)


def packs_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a cached pass with hidden states x (B, S, C) runs its linears on packed weights: a float32 CPU model
    with no autograd (the packed op has none), eager (never inside torch.compile), B*S in PACKED_ROWS, and oneDNN
    present."""
    if torch.compiler.is_compiling():  # first: traced, the row count below is symbolic
        return False
    return (_packing_ok[0] and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and x.shape[0] * x.shape[1] in PACKED_ROWS and not torch.is_grad_enabled()
            and not weight.is_inference())  # an inference tensor has no version counter


def linear(layer: nn.Linear, x: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """layer(x), on its packed weight where `packed` (see `packs_rows`). The packed copy is made at first use and
    again whenever the weight changes: another tensor, an in-place write (load_state_dict, a foreach step: the
    version counter), any optimizer step (`_forget_packed`: fused steps leave the counter alone); writes through
    `.data` outside an optimizer are not seen, and nothing writes the model's weights that way. It
    holds the weight it was made from, so no other tensor takes that address meanwhile. Costs one more copy of the
    weights in memory while the model lives."""
    if not packed:
        return layer(x)
    w = layer.weight
    entry = _packed.get(w)
    if entry is None or entry[1] != (w.data_ptr(), w._version):
        try:
            entry = (w.detach(), (w.data_ptr(), w._version), torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8))
        except RuntimeError:  # a build whose oneDNN cannot: F.linear from now on
            _packing_ok[0] = False
            return layer(x)
        _packed[w] = entry
    return torch.ops.mkldnn._linear_pointwise(x, entry[2], None, "none", [], "")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if x.dtype == self.weight.dtype == torch.float32:  # the same formula in one call (CPU: bit for bit)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x if x.dtype == torch.float64 else x.float()  # LLaMA's order: normalise in float32 (at least), cast
        # back, then scale in x's dtype (a bf16 stream over float32 weights stays bf16)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.cache: KVCache | None = None

    def forward(self, x, cos, sin, mask, cache_pos=None, packed: bool = False):
        B, S, _ = x.shape  # (B, S, C)
        H, Hkv = self.n_heads, self.n_kv
        qkv = linear(self.wqkv, x, packed).view(B, S, H + 2 * Hkv, self.hd).transpose(1, 2)  # (B, H + 2 Hkv, S, D)
        qk = rotate(qkv[:, :H + Hkv], cos, sin)  # queries and keys rotated together: one set of kernels
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv:]  # (B, H, S, D), (B, Hkv, S, D) x 2
        if cache_pos is not None:
            y = self._cached(q, k, v, mask, cache_pos)
        elif isinstance(mask, BlockMask):
            y = _flex(q, k, v, mask)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_kv != self.n_heads
            )
        return linear(self.wo, y.transpose(1, 2).reshape(B, S, -1), packed)

    def _cached(self, q, k, v, bias, cache_pos):
        """Write each input's key/value at its slot, then attend to [this pass's inputs | the first n cache slots]
        under `bias` (see `cached_attention_bias`).

        One SDPA call over a view of the cache (a fused kernel on CPU and GPU, no score matrix in memory).
        n = bias width - S <= n_slots: a caller may pass only the cache prefix its queries can see. The own
        inputs are also read from staging rows, not from their slots, because proxies share one scratch slot; the
        bias never shows a cache column of a slot written in the same pass (`KVCache.write`). Unwritten slots hold
        zeros (the cache is zeroed before its first cached forward, see `Transformer.reset_cache`), so a masked
        column gets weight exactly 0 (-inf + a finite score): no per-pass V hygiene copy.
        """
        if self.cache is None:
            raise RuntimeError("cached forward needs model.setup_cache(batch, n_slots) first")
        B, H, S, D = q.shape
        dtype = self.cache.k_buf.dtype
        if isinstance(bias, SplitKV):
            keys, values = self.cache.write(cache_pos, k, v, bias.width - S, bias.span)
            qg = q.to(dtype).reshape(B, self.n_kv, (H // self.n_kv) * S, D)
            return split_kv_attention(qg, keys, values, bias).reshape(B, H, S, D).type_as(q)
        if bias.dtype == torch.bool:  # called with the caller's mask, not the forward's prepared bias
            bias = cached_attention_bias(bias, H // self.n_kv, dtype)
        keys, values = self.cache.write(cache_pos, k, v, bias.shape[-1] - S)  # (B, Hkv, S + n, D)
        qg = q.to(dtype).reshape(B, self.n_kv, (H // self.n_kv) * S, D)  # GQA group folded into rows
        with sdpa_kernel(CACHED_SDPA_BACKENDS):
            y = F.scaled_dot_product_attention(qg, keys, values, attn_mask=bias)  # (B, Hkv, g*S, D)
        return y.reshape(B, H, S, D).type_as(q)  # reshape: SDPA may return a (B, g*S, Hkv, D) memory layout


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(gate) * up). `w13` holds [gate; up] (LLaMA's gate_proj over up_proj), one GEMM for both."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.mlp_dim, bias=False)
        self.w2 = nn.Linear(cfg.mlp_dim, cfg.dim, bias=False)

    def forward(self, x, packed: bool = False):
        gate, up = linear(self.w13, x, packed).chunk(2, dim=-1)
        return linear(self.w2, F.silu(gate) * up, packed)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, mask, cache_pos=None, packed: bool = False):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache_pos, packed)
        return x + self.feed_forward(self.ffn_norm(x), packed)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rope = ROPES[cfg.rope](cfg.head_dim, cfg.rope_base)
        self._cache_unused = False  # True from setup_cache until the first cached forward zeroes the cache
        # a compute setting, not the architecture (never saved): under autocast, the stream between blocks in this
        # dtype (torch.bfloat16 halves the bytes of every residual add, norm and checkpointed block input);
        # None: the embeddings' dtype (float32 weights -> a float32 stream, as LLaMA trains)
        self.residual_dtype: torch.dtype | None = None
        # a compute setting too: cached passes attend over this many slices of the keys at once (split_bias; 1:
        # one SDPA call), for passes with few query rows on a GPU with many more SMs than (batch x KV heads)
        self.kv_splits = 1
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

    def setup_cache(self, batch: int, n_slots: int, dtype=None, device=None, staging: int = 128) -> None:
        """Allocate a zeroed static KV cache of `n_slots` slots per layer (plus `staging` rows for a pass's own
        keys, see KVCache; a wider pass still works, with one copy), by default in the dtype the keys are
        computed in: the weights', or autocast's where it is on for that device (an fp32 cache would be cast,
        i.e. copied, in every attention call)."""
        device = torch.device(device or self.output.weight.device)
        dtype = self.cache_dtype(device) if dtype is None else dtype
        for layer in self.layers:
            layer.attention.cache = KVCache(batch, self.cfg.n_kv_heads, n_slots, self.cfg.head_dim, dtype, device,
                                            staging)
        self._cache_unused = True  # zeroed again at the first cached forward (see reset_cache)

    def cache_dtype(self, device) -> torch.dtype:
        """The dtype keys and values are computed in on `device`: autocast's where it is on, else the weights'."""
        return active_dtype(self.output.weight.dtype, device)

    def reset_cache(self) -> None:
        """Zero every slot in place (one memset per sequence, before the loop): an unwritten slot then holds 0
        and a masked column adds exactly 0, even where earlier code left NaN or inf in the cache."""
        for layer in self.layers:
            layer.attention.cache.k_buf.zero_()
            layer.attention.cache.v_buf.zero_()
        self._cache_unused = False

    def clear_cache(self) -> None:
        self.swap_caches(None)

    def kv_caches(self) -> list[KVCache] | None:
        """The layers' KV caches, in layer order (None when none is set up): a caller keeps them to `swap_caches`
        back in later (play keeps one set per group of games)."""
        caches = [layer.attention.cache for layer in self.layers]
        return None if caches[0] is None else caches

    def swap_caches(self, caches: list[KVCache] | None) -> list[KVCache] | None:
        """Install `caches` (from `kv_caches`; None: no cache) -> the ones they replace. The buffers move with
        their owner: nothing is copied or zeroed."""
        previous = self.kv_caches()
        if caches is not None and len(caches) != len(self.layers):
            raise ValueError(f"swap_caches: {len(caches)} caches for {len(self.layers)} layers")
        for layer, cache in zip(self.layers, caches or [None] * len(self.layers)):
            layer.attention.cache = cache
        return previous

    def forward(
        self,
        tokens: torch.Tensor,
        coords: torch.Tensor,
        mask: torch.Tensor | BlockMask | None = None,
        cache_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, S) long; coords (S, 4) or (B, S, 4) long (Layout.coords); returns logits (B, S, vocab) float32
        (float64 for a float64 model).

        mask: None (plain causal), dense bool (S, S) / (B, 1, S, S), or a BlockMask; in cached mode
        (cache_pos (S,) given) a bool (S, n + S) or (B|1, S, n + S) over [the first n <= n_slots cache slots |
        this pass's inputs], or that mask already made the attention bias (`cached_attention_bias`, in the cache's
        dtype): compiled, a bias built inside the graph is built again for every attention call.
        """
        if cache_pos is not None and self._cache_unused:
            self.reset_cache()  # first cached forward since setup_cache: anything written meanwhile is not ours
        cos, sin = self.rope(coords)  # (S, D/2) or (B, S, D/2)
        if cos.dim() == 2:
            cos, sin = cos[None], sin[None]
        cos, sin = rotation_tables(cos.unsqueeze(1), sin.unsqueeze(1))  # (B|1, 1, S, D)
        x = self.tok_embeddings(tokens)  # (B, S, C)
        if self.residual_dtype is not None and torch.is_autocast_enabled(x.device.type):
            x = x.to(self.residual_dtype)
        if cache_pos is not None and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            caches = self.kv_caches()
            dtype = x.dtype if caches is None else caches[0].k_buf.dtype
            mask = cached_attention_bias(mask, self.cfg.n_heads // self.cfg.n_kv_heads, dtype)
        if cache_pos is not None and self.kv_splits > 1 and not isinstance(mask, SplitKV) and \
                mask.shape[-1] >= 2 * self.kv_splits:
            mask = split_bias(mask, self.kv_splits)
        # a cached pass of a few rows on a float32 CPU: its linears on prepacked weights (`packs_rows`)
        packed = cache_pos is not None and packs_rows(x, self.output.weight)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache_pos, packed)
        logits = linear(self.output, self.norm(x), packed)
        return logits if logits.dtype == torch.float64 else logits.float()  # float64: exactness tests
