import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mcar.core.layout import Layout
from mcar.core.masks import CausalMask
from mcar.core.model import ModelConfig, Transformer
from mcar.core.rope import RoPE3D, apply_rope, rope_sections
from mcar.core.visibility import SlotTable, causal_table

from .conftest import compose


def tiny(vocab=40, **kw):
    cfg = dict(vocab_size=vocab, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=96) | kw
    return Transformer(ModelConfig(**cfg)).eval()


def test_coords_follow_layout_and_are_never_zero():
    lay = Layout(h=3, w=4, n_a=2)
    c = lay.coords(frames=2)
    assert c.shape == (2 * 14, 4)
    assert (c[:, :3] > 0).all(), "a zero coordinate means an identity rotation on that axis"
    assert c[lay.pos(1, 2, 3)].tolist() == [2, 3, 4, lay.pos(1, 2, 3)]
    assert c[lay.action_pos(0, 1)].tolist() == [1, 4, 2, 13]  # actions on virtual row h (1-based h+1)
    assert c[:, 3].tolist() == list(range(28))  # 1D RoPE's position: the flat slot index
    assert lay.is_image(2).sum() == 24


def test_rope_1d_is_llamas():
    """model.rope=1d equals LLaMA's RoPE (transformers' rotate_half convention, inv_freq = base^(-2i/D)) over the
    flat position, written out independently here; 3D RoPE ignores the position column."""
    from mcar.core.rope import RoPE1D

    D, base, lay = 16, 500.0, Layout(3, 4, 2)
    coords = lay.coords(2)
    x = torch.randn(2, 3, len(coords), D)
    cos, sin = RoPE1D(D, base)(coords)
    got = apply_rope(x, cos[None, None], sin[None, None])
    pos = torch.arange(len(coords), dtype=torch.float64)
    freqs = pos[:, None] * base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)[None]
    emb = torch.cat([freqs, freqs], -1)
    xd = x.double()
    rotate_half = torch.cat([-xd[..., D // 2:], xd[..., :D // 2]], -1)
    want = xd * emb.cos() + rotate_half * emb.sin()
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert torch.equal(torch.stack(RoPE3D(12)(coords)), torch.stack(RoPE3D(12)(coords[:, :3])))
    with pytest.raises(ValueError, match="position column"):
        RoPE1D(D)(coords[:, :3])


def test_rope_rotates_every_slot():
    lay, rope = Layout(3, 4, 2), RoPE3D(head_dim=12)
    cos, sin = rope(lay.coords(2))
    x = torch.randn(1, 1, 28, 12)
    y = apply_rope(x, cos[None, None], sin[None, None])
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)  # a rotation
    assert ((y - x).abs().amax(-1) > 1e-3).all(), "some slot got no rotation"
    assert sum(rope_sections(12)) == 6


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=3, max_size=3), st.lists(st.integers(1, 30), min_size=3, max_size=3),
       st.lists(st.integers(-5, 5), min_size=3, max_size=3))
def test_rope_scores_depend_only_on_coordinate_difference(a, b, shift):
    """q.k after 3D RoPE is a function of (coord_q - coord_k) on each axis."""
    rope = RoPE3D(head_dim=12)
    q, k = torch.randn(1, 1, 1, 12, dtype=torch.float64), torch.randn(1, 1, 1, 12, dtype=torch.float64)

    def score(cq, ck):
        cq_, sq_ = rope(torch.tensor([cq]))
        ck_, sk_ = rope(torch.tensor([ck]))
        return (apply_rope(q, cq_.double(), sq_.double()) * apply_rope(k, ck_.double(), sk_.double())).sum()

    moved = ([x + s + 10 for x, s in zip(a, shift)], [x + s + 10 for x, s in zip(b, shift)])
    assert torch.allclose(score(a, b), score(*moved), atol=1e-4)


def test_llama_parts_no_bias_untied_gqa():
    m = tiny()
    assert all(mod.bias is None for mod in m.modules() if isinstance(mod, torch.nn.Linear))
    assert m.output.weight.data_ptr() != m.tok_embeddings.weight.data_ptr()
    assert m.layers[0].attention.wqkv.out_features == (4 + 2 * 2) * 12  # 4 query heads, 2 kv heads
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(vocab_size=8, dim=48, n_heads=4, n_kv_heads=3)


@pytest.mark.parametrize("name,dim,mlp,heads", [("300m", 1024, 4096, 16), ("700m", 2048, 4096, 32),
                                                ("1.2b", 2048, 8192, 32)])
def test_paper_sizes(name, dim, mlp, heads):
    cfg = compose("train", [f"model={name}", "data=synthetic", "data.codebook_size=8192"])
    arch = cfg.model.arch
    assert (arch.dim, arch.mlp_dim, arch.n_heads, arch.n_layers) == (dim, mlp, heads, 20)
    assert cfg.model.warmup_steps == 10_000
    with torch.device("meta"):
        n = Transformer(ModelConfig(**arch)).num_params(embeddings=False)
    per_layer = 4 * dim * dim + 3 * dim * mlp + 2 * dim
    assert n == 20 * per_layer + dim + arch.vocab_size * dim  # + final norm + output head


def random_table(n: int, gen: torch.Generator) -> SlotTable:
    """A random schedule-like table: random feed passes, random proxies, positions a permutation."""
    return SlotTable(feed_pass=torch.randint(0, 5, (n,), generator=gen), pos=torch.randperm(n, generator=gen),
                     is_proxy=torch.rand(n, generator=gen) < 0.2)


@pytest.mark.parametrize("kind", ["causal", "random"])
def test_dense_sdpa_and_flex_blockmask_agree(kind):
    """The CPU path (SDPA + dense bool) and the GPU path (flex + BlockMask) from one mask function."""
    lay, frames = Layout(3, 4, 2), 4
    n = lay.n_slots(frames)
    table = causal_table(n) if kind == "causal" else random_table(n, torch.Generator().manual_seed(1))
    m, tokens, coords = tiny(), torch.randint(0, 40, (2, n)), lay.coords(frames)
    with torch.no_grad():
        dense = m(tokens, coords, table.dense())
        flex = m(tokens, coords, table.block_mask(block_size=16))
    torch.testing.assert_close(dense, flex, rtol=1e-4, atol=1e-4)
    if kind == "causal":
        torch.testing.assert_close(dense, m(tokens, coords, None), rtol=1e-5, atol=1e-5)


def test_mask_rule_on_a_handmade_table():
    t = SlotTable(feed_pass=torch.tensor([0, 0, 1, 1]), pos=torch.tensor([0, 1, 3, 2]),
                  is_proxy=torch.tensor([False, False, False, True]))
    expected = torch.tensor([[1, 0, 0, 0],
                             [1, 1, 0, 0],
                             [1, 1, 1, 0],   # slot 3 is a proxy: only its own query sees it
                             [1, 1, 0, 1]], dtype=torch.bool)  # pos 3 > pos 2: hidden from the proxy
    assert torch.equal(t.dense(), expected)
    full = SlotTable(t.feed_pass, t.pos, t.is_proxy, full=True).dense()
    assert full[1, 0] and not full[0, 1]


@pytest.mark.parametrize("chunk", [1, 5])
def test_cached_forward_matches_parallel_and_ignores_unwritten_nan(chunk):
    lay, frames = Layout(3, 4, 2), 3
    n = lay.n_slots(frames)
    m, tokens, coords = tiny(), torch.randint(0, 40, (2, n)), lay.coords(frames)
    with torch.no_grad():
        ref = m(tokens, coords, None)
        m.setup_cache(2, n)
        for layer in m.layers:  # unwritten slots must never be read, not even as NaN * 0
            layer.attention.cache.k.fill_(float("nan"))
            layer.attention.cache.v.fill_(float("nan"))
        outs = []
        for s in range(0, n, chunk):
            pos = torch.arange(s, min(s + chunk, n))
            mask = torch.zeros(len(pos), n + len(pos), dtype=torch.bool)
            mask[:, :s] = True  # all earlier slots are in the cache
            mask[:, n:] = torch.ones(len(pos), len(pos), dtype=torch.bool).tril()
            outs.append(m(tokens[:, pos], coords[pos], mask[None], pos))
        m.clear_cache()
    got = torch.cat(outs, 1)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_causal_targets_only_image_tokens():
    lay, frames = Layout(2, 2, 1), 2
    clip = torch.arange(10)[None]
    b = CausalMask(lay, frames)(clip)
    # slots: [c c c c a | c c c c a]; slot p predicts clip[p+1] when p+1 is an image slot
    assert b.targets[0].tolist() == [1, 2, 3, -100, 5, 6, 7, 8, -100, -100]
    with_actions = CausalMask(lay, frames, action_loss=True)(clip)
    assert with_actions.targets[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, -100]
    with pytest.raises(ValueError, match="layout wants"):
        CausalMask(lay, 3)(clip)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([torch.float32, torch.bfloat16]))
def test_rotate_is_apply_rope_bit_for_bit(seed, dtype):
    """The model's rotation (full-width tables, half the kernels) equals apply_rope exactly, in both dtypes."""
    from mcar.core.rope import rotate, rotation_tables

    g = torch.Generator().manual_seed(seed)
    lay, rope = Layout(3, 4, 2), RoPE3D(head_dim=12)
    cos, sin = rope(lay.coords(2) * torch.randint(1, 50, (1,), generator=g))
    x = torch.randn(2, 3, 28, 12, generator=g).to(dtype)
    want = apply_rope(x, cos[None, None], sin[None, None])
    got = rotate(x, *rotation_tables(cos[None, None], sin[None, None]))
    assert got.dtype == dtype and torch.equal(got, want)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([8, 48, 128]), st.integers(-3, 3))
def test_rms_norm_fast_path_is_the_formula(seed, dim, scale):
    """RMSNorm's float32 path (F.rms_norm) equals LLaMA's formula written out, bit for bit on CPU."""
    from mcar.core.model import RMSNorm

    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=g))
    x = torch.randn(2, 5, dim, generator=g) * 10.0**scale
    want = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)) * norm.weight
    assert torch.equal(norm(x), want)
    xb = x.bfloat16()  # other dtypes: normalise in float32, cast, then scale in x's dtype (LLaMA's order)
    want_b = (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16() \
        * norm.weight.bfloat16()
    got_b = norm(xb)
    assert got_b.dtype == torch.bfloat16 and torch.equal(got_b, want_b)  # a bf16 stream stays bf16
    xd = x.double()  # float64 (exactness tests): normalised in float64, not rounded through float32
    want_d = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    torch.testing.assert_close(norm.double()(xd), want_d, rtol=1e-14, atol=0)


def test_bf16_residual_stream_under_autocast():
    """Transformer.residual_dtype=bfloat16 (train.yaml residual_dtype): under autocast every block reads and
    returns a bf16 stream, the loss stays within bf16 rounding of the float32 stream's and gradients reach every
    weight; without autocast (CPU float32) the setting changes nothing."""
    torch.manual_seed(0)
    model = tiny().train()
    lay = Layout(3, 4, 2)
    coords = lay.coords(2)
    tokens = torch.randint(0, 40, (2, len(coords)))
    seen = []
    hooks = [layer.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
             for layer in model.layers]
    plain = model(tokens, coords)
    model.residual_dtype = torch.bfloat16
    assert torch.equal(model(tokens, coords), plain)  # no autocast: float32 throughout
    assert set(seen) == {(torch.float32, torch.float32)}
    losses = {}
    for dtype in (None, torch.bfloat16):
        model.residual_dtype, seen[:] = dtype, []
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens, coords)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
        losses[dtype] = loss.item()
        stream = torch.float32 if dtype is None else torch.bfloat16
        assert set(seen) == {(stream, stream)} and logits.dtype == torch.float32
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert abs(losses[None] - losses[torch.bfloat16]) < 0.02 * losses[None]
    for h in hooks:
        h.remove()


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 3), rows=st.integers(1, 6), cached=st.integers(0, 40), kv_heads=st.sampled_from([1, 2, 4]),
       chunks=st.integers(2, 9), seed=st.integers(0, 2**16))
def test_split_kv_attention_equals_one_sdpa_call(batch, rows, cached, kv_heads, chunks, seed):
    """model.kv_splits = c (flash-decoding: the keys in c slices, combined by their log-sum-exp) gives a cached pass
    the logits of one SDPA call, float64, for any mask (chunks that show a row nothing included), batch, GQA
    grouping and cache prefix; it reads the cache in place."""
    import mcar.core.model as model_mod

    g = torch.Generator().manual_seed(seed)
    cfg = ModelConfig(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=kv_heads, mlp_dim=64, init_std=0.2)
    torch.manual_seed(seed)
    model = Transformer(cfg).double().eval()
    model.setup_cache(batch, cached + rows + 1)
    coords = torch.randint(0, 9, (rows, 4), generator=g)
    tokens = torch.randint(0, 40, (batch, rows), generator=g)
    mask = torch.rand(rows, cached + rows, generator=g) < 0.3
    mask[:, cached:] |= torch.eye(rows, dtype=torch.bool)  # each input sees itself
    for layer in model.layers:  # a cache written earlier (random keys and values)
        layer.attention.cache.k_buf.copy_(torch.randn(layer.attention.cache.k_buf.shape, generator=g))
        layer.attention.cache.v_buf.copy_(torch.randn(layer.attention.cache.v_buf.shape, generator=g))
    pos = torch.arange(cached, cached + rows)
    ref = model(tokens, coords, mask, pos)
    read = []
    fused = model_mod._attention_with_lse
    model_mod._attention_with_lse = lambda q, k, v, b: read.append(k.untyped_storage().data_ptr()) or fused(q, k, v, b)
    try:
        model.kv_splits = chunks
        split = model(tokens, coords, mask, pos)
    finally:
        model_mod._attention_with_lse = fused
    torch.testing.assert_close(split, ref, rtol=0, atol=1e-12)
    if cached + rows >= 2 * chunks:  # split (narrower passes keep one call)
        caches = [layer.attention.cache.k_buf.untyped_storage().data_ptr() for layer in model.layers]
        assert read == caches or (cached == 0 and len(read) == 2)  # the prefill concatenates (no prefix to view)
    else:
        assert read == []
