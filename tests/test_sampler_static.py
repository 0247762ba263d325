"""The static (GPU) sampler path: bucketed shapes that fit the work, the eager path's tokens for the same seed,
and compile=auto. Tiny random float32 models on CPU; the compiled path is traced with a counting backend, and once
(slow) really compiled by inductor on CPU."""
import functools
import shutil

import pytest
import torch

import mcar.core.compiling as compiling
import mcar.core.keyed_rng as keyed_rng
import mcar.core.sampler as sampler_mod
from mcar.checkpoint.config import packaged_group_config
from mcar.core.buckets import no_lone_ones, pass_widths
from mcar.core.keyed_rng import keyed_exponential
from mcar.core.layout import Layout
from mcar.core.model import ModelConfig, Transformer
from mcar.core.sampler import ScheduleSampler, build_sampler

from .test_parity import clip_for, sample  # the same (V, T) clips

V, T = 32, 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=64, init_std=0.2)
    return Transformer(cfg).eval()




CONFIGS = {  # name -> (sampler class, n_a, prompt frames, sampler arguments)
    "k2_d3": (ScheduleSampler, 2, 1, dict(k=2, d=3)),
    "k1_above_no_actions_top_k": (ScheduleSampler, 0, 1, dict(k=1, proxy="above", top_k=8)),
    "k2_top_p_temperature": (ScheduleSampler, 2, 1, dict(k=2, top_p=0.9, temperature=0.8)),
    "k2_d2_top_k_top_p_2_prompt_frames": (ScheduleSampler, 2, 2, dict(k=2, d=2, top_k=5, top_p=0.95)),
    "k6_idle_passes": (ScheduleSampler, 2, 1, dict(k=6)),
    "ntp": (ScheduleSampler.ntp, 2, 1, {}),
    "ntp_no_actions_top_k": (ScheduleSampler.ntp, 0, 1, dict(top_k=4)),
    "k2_one_width": (ScheduleSampler, 2, 1, dict(k=2, d=3, static_widths=1)),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_static_equals_eager_for_the_same_seed(model, name):
    """Padding and bucketing do not touch the random stream: the same tokens, token for token (batch 2)."""
    cls, n_a, P, kw = CONFIGS[name]
    layout = Layout(3, 4, n_a)
    clip = clip_for(layout)
    eager = cls(layout, T, P, seed=5, **kw)
    static = cls(layout, T, P, seed=5, static=True, **kw)
    a, sa = eager.generate(model, clip)
    b, sb = static.generate(model, clip)
    assert torch.equal(a, b) and sa.passes == sb.passes
    assert len(static.static_plan(static.schedule(), "cpu").buckets) > 1  # bucketing was exercised
    gen = eager.schedule().gen_slots
    assert not torch.equal(a[0, gen], a[1, gen])  # the two streams of the batch draw differently
    other, _ = cls(layout, T, P, seed=6, static=True, **kw).generate(model, clip)
    assert not torch.equal(other[:, gen], b[:, gen])  # the seed matters
    assert torch.equal(static.generate(model, clip, setup_cache=False)[0], b)  # reproducible on a reused cache


def test_bucketed_shapes_fit_the_paper_geometry():
    """H=14, w=24, n_a=11, 16 frames: tens of buckets, not one shape padded to the widest pass and the whole cache."""
    layout = Layout(14, 24, 11)
    N = layout.n_slots(16)
    expect = {"ntp": (ScheduleSampler.ntp(layout, 16), 30), "diagd k=2": (ScheduleSampler(layout, 16, k=2), 46)}
    for name, (s, n_buckets) in expect.items():
        st = s.static_plan(s.schedule(), "cpu")
        assert len(st.buckets) == n_buckets, name
        assert st.cache_cols_per_pass < 1.1 * st.real_cols < 0.6 * (N + 1), name  # was the whole cache (N + 1)
        for b in st.buckets:
            assert b.mask.shape[-1] - b.mask.shape[-2] <= N  # a prefix view of the cache, never the scratch slot
    ntp = expect["ntp"][0].static_plan(expect["ntp"][0].schedule(), "cpu")
    # token passes run 2 rows, not 12: 1 padded, as a size 1 would be a compiled graph of its own (no_lone_ones)
    assert sorted({b.src.shape[1] for b in ntp.buckets}) == [2, 12]
    assert ntp.rows_per_pass == pytest.approx(ntp.real_rows + 1, abs=0.01)
    diag = expect["diagd k=2"][0].static_plan(expect["diagd k=2"][0].schedule(), "cpu")
    assert diag.rows_per_pass < 9 < 13  # 7.2 real rows a pass, padded to 13 before


def test_pass_widths_pad_the_fewest_rows():
    assert pass_widths([1] * 100 + [12] * 3, 3) == [1, 12]
    assert pass_widths([1, 2, 3, 4], 1) == [4]
    assert pass_widths([1] * 30 + [2] * 60 + [12] * 89 + [13] * 30, 3) == [2, 12, 13]
    assert pass_widths([5, 5], 3) == [5]
    assert no_lone_ones([1, 12]) == [2, 12] and no_lone_ones([1, 1]) == [1, 1]  # all 1: nothing to specialise away


def test_keyed_draws_are_a_fair_sample():
    """The exponential race on keyed noise samples the softmax: frequencies match over many keys."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, -3.0])
    keys = keyed_rng.mix32(torch.arange(40_000))
    tokens = sample(logits.expand(len(keys), -1), key=keys)
    freq = torch.bincount(tokens, minlength=6).float() / len(keys)
    assert (freq - logits.softmax(-1)).abs().max() < 0.01
    e = keyed_exponential(keys[:2000], 64)
    assert 0.97 < e.mean() < 1.03 and (e > 0).all() and torch.isfinite(e).all()
    assert torch.equal(keyed_exponential(keys[:3], 64), keyed_exponential(keys[:3], 64))
    top2 = sample(logits.expand(1000, -1), top_k=2, key=keys[:1000])
    assert set(top2.tolist()) == {0, 1}


def test_slot_noise_is_the_per_output_hash():
    """SlotNoise (hashed once per run) gives output (b, slot) the key mix32(mix32(seed key ^ b) ^ slot), computed
    here on Python ints, and the draws keyed_exponential makes from that key alone."""
    key = keyed_rng.seed_key(123)
    noise = keyed_rng.SlotNoise.of(key, 3, 17, 10, "cpu")
    mix = keyed_rng.mix32
    assert noise.keys.tolist() == [[mix(mix(key ^ b) ^ slot) for slot in range(17)] for b in range(3)]
    assert torch.equal(keyed_exponential(noise.keys, 10, noise.codes), keyed_exponential(noise.keys, 10))


def test_compile_auto_is_on_for_cuda_only(model):
    layout = Layout(3, 4, 2)
    for name in ("ntp", "diagd"):
        s = build_sampler(packaged_group_config("sampler", name), layout, T)
        assert s.compile == "auto"
        assert not s.compiles("cpu") and not s.is_static("cpu")  # eager on CPU
        assert s.compiles("cuda") and s.is_static(torch.device("cuda", 0))
        assert s.generate(model, clip_for(layout))[0].shape == (2, layout.n_slots(T))
    assert ScheduleSampler(layout, T, compile=True).compiles("cpu")
    assert not ScheduleSampler(layout, T, compile=False).compiles("cuda")
    assert ScheduleSampler(layout, T, static=True).is_static("cpu")
    with pytest.raises(ValueError, match="compile"):
        ScheduleSampler(layout, T, compile="sometimes")


def test_generate_reuses_a_fitting_cache(model):
    """Setup_cache=True keeps a cache of the right shape (zeroed in place): compiled CUDA graphs read its buffers."""
    layout = Layout(3, 4, 2)
    s = ScheduleSampler(layout, T, k=2, temperature=0)
    a, _ = s.generate(model, clip_for(layout))
    cache = model.layers[0].attention.cache
    for layer in model.layers:
        layer.attention.cache.k.fill_(float("nan"))
    b, _ = s.generate(model, clip_for(layout))
    assert model.layers[0].attention.cache is cache and torch.equal(a, b)
    s.generate(model, clip_for(layout, batch=1))  # another batch size: a new cache
    assert model.layers[0].attention.cache is not cache


def test_compiled_step_traces_whole_and_a_few_times(model, monkeypatch):
    """The compiled path (here dynamo with a counting backend, no inductor) gives the eager tokens without graph
    breaks, compiles once per sampler for all its buckets (split-KV on or off: one trace, no guard failing from one
    bucket to the next), and samplers of other rules in one process do not share dynamo's limit of 8 recompiles
    (fullgraph: hitting it raises)."""
    from torch._dynamo.testing import CompileCounter

    assert compiling.COMPILE_OPTIONS == dict(mode="reduce-overhead", dynamic=True)
    assert compiling.CPU_COMPILE_OPTIONS == dict(dynamic=True, options={"cpp_wrapper": True})
    torch._dynamo.reset()
    counter = CompileCounter()
    monkeypatch.setattr(compiling, "CPU_COMPILE_OPTIONS", dict(backend=counter, fullgraph=True, dynamic=True))
    layout = Layout(3, 4, 2)
    clip = clip_for(layout)
    runs = [(ScheduleSampler, dict(k=2, d=3, top_k=8, top_p=0.9), clip), (ScheduleSampler.ntp, {}, clip),
            (ScheduleSampler, dict(k=1, temperature=0, kv_splits=3), clip[:1])]
    for cls, kw, c in runs:
        before = counter.frame_count
        compiled = cls(layout, T, seed=2, compile=True, **kw)
        tokens = compiled.generate(model, c)[0]
        assert torch.equal(tokens, cls(layout, T, seed=2, **kw).generate(model, c)[0])
        assert len(compiled.static_plan(compiled.schedule(), "cpu").buckets) >= 6
        assert counter.frame_count - before == 1, (kw, counter.frame_count - before)
        step = compiled._compiled[sampler_mod._sample_pass]

        def no_floats(*args, step=step):  # a Python float would become a CPU graph input: CUDA graphs off
            rule = args[-1]
            assert isinstance(rule, sampler_mod.SamplingRule) and not any(isinstance(a, float) for a in args)
            assert not isinstance(rule.temperature, float) and not isinstance(rule.top_p, float)
            return step(*args)

        compiled._compiled[sampler_mod._sample_pass] = no_floats
        assert torch.equal(compiled.generate(model, c, setup_cache=False)[0], tokens)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["ntp", "diagd"])
def test_one_compiled_graph_serves_every_pass_of_a_rollout(model, monkeypatch, name):
    """A rollout over several advances with split-KV on (play's one-player path), NTP and DiagD: the compiled step
    is one dynamo graph (fullgraph: a graph break raises), no guard failing from one pass to the next, with the eager
    tokens. Split-KV's slices are a whole multiple of 16 key columns (the remainder of a width was guarded: a
    recompile when the next pass's differed, and its cache offset read under trace broke the graph); a dimension 1
    in one bucket and larger in another is padded to 2 (dynamo specialises a size 1: NTP's 1-row passes were a graph
    of their own); sizes equal by chance at the first trace get symbols of their own (`one_trace_per_step`)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    monkeypatch.setattr(compiling, "CPU_COMPILE_OPTIONS", dict(backend=counter, fullgraph=True, dynamic=True))
    layout, frames = Layout(3, 4, 2), 6
    clip = clip_for(layout, frames, batch=1)
    make = ScheduleSampler.ntp if name == "ntp" else functools.partial(ScheduleSampler, k=2)
    kw = dict(seed=2, kv_splits=3, context=3)  # a ring of 3 frames: 4 steady advances
    tokens = make(layout, frames, 1, compile=True, **kw).generate(model, clip)[0]
    torch._dynamo.reset()
    assert counter.frame_count == 1
    assert torch.equal(tokens, make(layout, frames, 1, **kw).generate(model, clip)[0])


def test_compiled_step_reads_every_input_at_a_fixed_address(model, monkeypatch):
    """Under CUDA graphs a graph input that is not static is copied into the graph at every replay (one kernel per
    tensor), and a bias built inside the graph is copied per attention call: every tensor the compiled step takes
    is marked static and keeps its address for the whole sequence and the next (one set per bucket), and the mask
    arrives as the attention bias, aligned, built with the plan (not per generate, nor in the graph)."""
    from torch._dynamo.utils import get_static_address_type

    import mcar.core.buckets as buckets_mod
    import mcar.core.model as model_mod

    torch._dynamo.reset()
    monkeypatch.setattr(compiling, "CPU_COMPILE_OPTIONS", dict(backend="eager", fullgraph=True, dynamic=True))
    built = {"plan": 0, "forward": 0}
    for mod, name in ((buckets_mod, "plan"), (model_mod, "forward")):
        def counted(*a, _f=mod.padded_attention_bias, _name=name):
            built[_name] += 1
            return _f(*a)
        monkeypatch.setattr(mod, "padded_attention_bias", counted)
    layout = Layout(3, 4, 2)
    s = ScheduleSampler(layout, T, seed=2, compile=True, k=2, top_p=0.9, temperature=0.8)
    step, calls = s.step_fn(sampler_mod._sample_pass, "cpu"), []

    def record(model, tokens, p, noise, rule):
        args = [tokens, *p, noise.keys, noise.codes, rule.temperature, rule.top_p]
        assert all(get_static_address_type(t) is not None for t in args)
        width = p.mask.shape[-1]  # a whole number of 16 columns, or as far as the cache reaches
        assert p.mask.dtype == torch.float32 and p.mask.is_contiguous()
        assert width % 16 == 0 or width - len(p.src) == layout.n_slots(T) + 1
        calls.append(tuple(t.data_ptr() for t in args))
        return step(model, tokens, p, noise, rule)

    s._compiled[sampler_mod._sample_pass] = record
    s.generate(model, clip_for(layout))  # compiles
    n_buckets = len(s.static_plan(s.schedule(), "cpu").buckets)
    assert built == {"plan": n_buckets, "forward": 1}  # the buckets' biases, the eager prefill's; none traced
    s.generate(model, clip_for(layout), setup_cache=False)
    assert built == {"plan": n_buckets, "forward": 2}  # no bias rebuilt but the prefill's
    assert len({c[1:7] for c in calls}) == n_buckets  # one address per bucket and field, every pass
    assert len({c[:1] + c[7:] for c in calls}) == 1  # tokens, noise and rule: one address, both sequences
    torch._dynamo.reset()


def test_compiled_step_takes_no_python_float_as_a_graph_input(model, monkeypatch):
    """The model's floats (RMSNorm eps) are constants of the graph: under dynamic=True each was a CPU float64 input,
    a host kernel and a host-to-device copy before every CUDA graph replay."""
    torch._dynamo.reset()
    inputs = []

    def record(gm, example_inputs):
        inputs.extend(example_inputs)
        return gm

    monkeypatch.setattr(compiling, "CPU_COMPILE_OPTIONS", dict(backend=record, fullgraph=True, dynamic=True))
    layout = Layout(3, 4, 2)
    ScheduleSampler(layout, T, seed=2, compile=True, k=2, top_p=0.9).generate(model, clip_for(layout))
    torch._dynamo.reset()
    assert inputs, "nothing was compiled"
    floats = [x for x in inputs if isinstance(x, torch.SymFloat) or (isinstance(x, torch.Tensor) and x.ndim == 0
                                                                       and x.dtype == torch.float64)]
    assert not floats, f"{len(floats)} float graph inputs"


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("g++") and not shutil.which("c++"), reason="inductor on CPU needs a C++ compiler")
def test_compiled_on_cpu_gives_the_eager_tokens(model):
    """Sampler.compile=true on CPU: real inductor with its C++ wrapper (CPU_COMPILE_OPTIONS), the same tokens as eager
    (greedy: float rounding of fused kernels cannot flip a keyed draw's argmax here unless two logits tie)."""
    torch._dynamo.reset()
    layout = Layout(3, 4, 2)
    clip = clip_for(layout)[:1]
    compiled = ScheduleSampler(layout, T, seed=1, compile=True, k=2, temperature=0)
    assert compiled.compiles("cpu")
    tokens, stats = compiled.generate(model, clip)
    want, want_stats = ScheduleSampler(layout, T, seed=1, k=2, temperature=0).generate(model, clip)
    assert torch.equal(tokens, want) and stats.passes == want_stats.passes
    assert torch.equal(compiled.generate(model, clip, setup_cache=False)[0], want)  # compiled once, run again
    torch._dynamo.reset()
