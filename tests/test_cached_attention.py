"""The cached (sampling) attention: one SDPA call over the cache read in place, exact against the one-pass masked
forward (GQA, per-batch masks, passes wider than the staging rows), and the sampling dtype of every entry point:
bfloat16 weights and KV cache on CUDA, float32 on CPU."""
import pytest
import torch
import torch.nn.functional as F

from mcar.core.model import ModelConfig, Transformer

from .conftest import SMALL_DATA, compose


def tiny(n_heads=4, n_kv_heads=2, vocab=40):
    cfg = ModelConfig(vocab_size=vocab, dim=48, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads, mlp_dim=96,
                      init_std=0.2)
    return Transformer(cfg).eval()


def random_visibility(B: int, n: int, chunk: int, gen: torch.Generator) -> torch.Tensor:
    """(B, n, n) bool: a query sees a random part of earlier chunks (its own per batch row), and its own chunk
    causally. Fed chunk by chunk, that is a sampler's pass structure."""
    vis = torch.rand(B, n, n, generator=gen) < 0.6
    chunk_of = torch.arange(n) // chunk
    earlier = chunk_of[None, :] < chunk_of[:, None]
    same = (chunk_of[None, :] == chunk_of[:, None]) & (torch.arange(n)[None, :] <= torch.arange(n)[:, None])
    return (vis & earlier) | same


def cached_passes(m, tokens, coords, vis, chunk, extra_cols=0, staging=128):
    """Feed `chunk` slots per pass; each pass's mask covers the written prefix plus `extra_cols` unwritten
    (masked) cache slots, which hold NaN before the cache is first used."""
    B, n = tokens.shape
    m.setup_cache(B, n, staging=staging)
    for layer in m.layers:
        layer.attention.cache.k.fill_(float("nan"))
        layer.attention.cache.v.fill_(float("nan"))
    outs = []
    for s in range(0, n, chunk):
        pos = torch.arange(s, min(s + chunk, n))
        width = min(s + extra_cols, n)
        mask = torch.zeros(B, len(pos), width + len(pos), dtype=torch.bool)
        mask[:, :, :s] = vis[:, pos, :s]
        mask[:, :, width:] = vis[:, pos][:, :, pos]
        outs.append(m(tokens[:, pos], coords[pos], mask, pos))
    m.clear_cache()
    return torch.cat(outs, 1)


@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("chunk, staging", [(3, 128), (7, 4)])  # 7 > 4: the pass does not fit the staging rows
def test_cached_forward_equals_the_masked_one_pass_forward(n_heads, n_kv_heads, chunk, staging):
    from mcar.core.layout import Layout

    torch.manual_seed(0)
    lay, frames, B = Layout(3, 4, 2), 3, 2
    n = lay.n_slots(frames)
    m, coords = tiny(n_heads, n_kv_heads), lay.coords(frames)
    tokens = torch.randint(0, 40, (B, n))
    vis = random_visibility(B, n, chunk, torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(tokens, coords, vis[:, None])
        got = cached_passes(m, tokens, coords, vis, chunk, extra_cols=5, staging=staging)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_attention_reads_the_cache_in_place(monkeypatch):
    """One fused SDPA call per layer whose keys and values are views of the cache buffer: the visible cache is
    neither concatenated with the pass's own keys nor copied (the old path: two bmm's and a softmax)."""
    m = tiny()
    m.setup_cache(1, 20)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kw):
        calls.append((k, v))
        return sdpa(q, k, v, *args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    coords = torch.ones(3, 3, dtype=torch.long)
    with torch.no_grad():
        m(torch.zeros(1, 3, dtype=torch.long), coords, torch.ones(3, 3, dtype=torch.bool).tril(), torch.arange(3))
        calls.clear()
        mask = torch.ones(2, 10 + 2, dtype=torch.bool)  # 10 cache slots visible, then the pass's own 2
        m(torch.zeros(1, 2, dtype=torch.long), coords[:2], mask, torch.arange(3, 5))
    assert len(calls) == len(m.layers)
    for (k, v), layer in zip(calls, m.layers):
        cache = layer.attention.cache
        assert k.shape[2] == v.shape[2] == 12
        assert k.untyped_storage().data_ptr() == cache.k_buf.untyped_storage().data_ptr()
        assert v.untyped_storage().data_ptr() == cache.v_buf.untyped_storage().data_ptr()


def test_bfloat16_cache_follows_the_weights_and_autocast():
    m = tiny()
    m.setup_cache(1, 8)
    assert m.layers[0].attention.cache.k.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the dashboard's CUDA autocast, on the CPU
        m.setup_cache(1, 8)
    assert m.layers[0].attention.cache.k.dtype == torch.bfloat16
    m.to(torch.bfloat16).setup_cache(1, 8)
    assert all(layer.attention.cache.k.dtype == layer.attention.cache.v.dtype == torch.bfloat16 for layer in m.layers)


def tiny_checkpoint(tmp_path):
    from mcar.train.module import MCARModule

    hp = dict(arch=dict(vocab_size=40, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=96),
              layout=dict(h=3, w=4, n_a=2), clip_frames=3, mask={"name": "causal"}, optim={}, max_steps=1)
    path = tmp_path / "tiny.ckpt"
    torch.save({"hyper_parameters": hp, "state_dict": MCARModule(**hp).state_dict()}, path)
    return path


def test_load_model_dtype(tmp_path):
    from mcar.checkpoint.load import load_model, sampling_dtype
    from mcar.core.layout import Layout
    from mcar.core.sampler import ScheduleSampler

    path = tiny_checkpoint(tmp_path)
    fp32, _ = load_model(path, "cpu")  # the default on CPU: unchanged
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}
    bf16, _ = load_model(path, "cpu", dtype="bfloat16")
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert bf16.model.rope.inv_freq.dtype == torch.float32  # buffers are not cast: RoPE stays exact
    lay = Layout(3, 4, 2)
    clip = torch.randint(0, 32, (1, lay.n_slots(3)))
    sampler = ScheduleSampler(lay, 3, 1, k=2)
    tf32, tf16 = sampler.teacher_forced(fp32.model, clip), sampler.teacher_forced(bf16.model, clip)
    assert all(layer.attention.cache.k.dtype == torch.bfloat16 for layer in bf16.model.layers)
    assert ((tf16.logits - tf32.logits).abs().max() / tf32.logits.abs().max()).item() < 0.05
    assert sampling_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert sampling_dtype(None, "cpu") == torch.float32 and sampling_dtype("float32", "cuda") == torch.float32
    with pytest.raises(ValueError, match="dtype='half'"):
        sampling_dtype("half", "cpu")


class Loaded(Exception):
    pass


@pytest.mark.parametrize("entry, overrides", [("evaluate", ["n_clips=1"]), ("generate", [])])
@pytest.mark.parametrize("device, dtype, expected", [("cuda", "auto", torch.bfloat16), ("cpu", "auto", torch.float32),
                                                     ("cuda", "float32", torch.float32)])
def test_entry_points_sample_in_bfloat16_on_cuda(monkeypatch, tmp_path, entry, overrides, device, dtype, expected):
    """evaluate and generate ask load_model for bfloat16 on a (mocked) CUDA device, float32 on CPU."""
    import importlib

    mod = importlib.import_module({"evaluate": "mcar.eval.evaluate"}.get(entry, f"mcar.tools.{entry}"))
    seen = {}

    def fake_load_model(ckpt, device, dtype=None):
        seen.update(device=torch.device(device), dtype=dtype)
        raise Loaded

    import mcar.sampling.world_model

    for where in (mod, mcar.sampling.world_model):  # every sampling tool loads through WorldModel.load
        if hasattr(where, "load_model"):
            monkeypatch.setattr(where, "load_model", fake_load_model)
    cfg = compose(entry, [*SMALL_DATA, "ckpt=unused.ckpt", f"device={device}", f"dtype={dtype}",
                          f"paths.output_dir={tmp_path}", *overrides])
    with pytest.raises(Loaded):
        getattr(mod, entry)(cfg)
    assert seen == {"device": torch.device(device), "dtype": expected}


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_dashboard_samples_under_bfloat16_autocast_on_cuda_only():
    from mcar.train.dashboard import sampling_autocast

    ctx = sampling_autocast(torch.device("cuda"))
    assert isinstance(ctx, torch.autocast) and ctx.device == "cuda" and ctx.fast_dtype == torch.bfloat16
    assert not isinstance(sampling_autocast(torch.device("cpu")), torch.autocast)
