"""The rolling KV cache (mcar.core.rolling, docs/diagd.md section 7): a rollout past the clip length is exact.

Tiny random float32 models; every comparison is token for token, greedy and seeded, eager and static (batch 2)."""
import copy

import pytest
import torch

import mcar.core.compiling as compiling
import mcar.core.sampler as sampler_mod
from mcar.core.keyed_rng import SlotNoise, seed_key
from mcar.core.layout import Layout
from mcar.core.model import ModelConfig, Transformer
from mcar.core.sampler import SamplingRule, ScheduleSampler, forward_rows, sample_slots
from mcar.core.schedule import Schedule

from .conftest import REPO, compose
from .test_parity import clip_for

V, N, C = 32, 8, 3  # vocabulary, frames generated (prompt included), context: N > C
LAYOUT = Layout(3, 4, 2)  # s_spa = 2*k + 4
SAMPLING = {"greedy": dict(temperature=0.0), "seeded": dict(seed=5, top_k=8)}


def tiny(n_layers: int) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, mlp_dim=64, init_std=0.2)
    return Transformer(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return tiny(2)


def sampler(name: str, frames: int = N, prompt_frames: int = 1, **kw) -> ScheduleSampler:
    if name == "ntp":
        return ScheduleSampler.ntp(LAYOUT, frames, prompt_frames, **kw)
    return ScheduleSampler(LAYOUT, frames, prompt_frames, k=2, **kw)


class ShiftedTime:
    """A model seen `frames` frames later: every RoPE coordinate moved on (time + frames, flat position + frames*L)."""

    def __init__(self, model, frames: int):
        self.model, self.shift = model, torch.tensor([frames, 0, 0, frames * LAYOUT.frame_len])

    def __call__(self, tokens, coords, mask=None, cache_pos=None):
        return self.model(tokens, coords + self.shift, mask, cache_pos)

    def __getattr__(self, name):
        return getattr(self.model, name)


def reprefilled(model, name: str, clip: torch.Tensor, monkeypatch, **kw) -> torch.Tensor:
    """The reference: before every frame u, a fresh sampler prefills the window (frames u-C+1..u-1 and their
    actions) at the positions and noise keys those slots have in the long clip, and generates frame u."""
    L, hw = LAYOUT.frame_len, LAYOUT.frame_tokens
    out, of = clip.clone(), SlotNoise.of.__func__
    for u in range(1, N):
        w0 = max(0, u - C + 1)
        monkeypatch.setattr(SlotNoise, "of", classmethod(
            lambda cls, key, b, n, nv, dev, o=w0 * L: cls(of(cls, key, b, n + o, nv, dev).keys[:, o:],
                                                          of(cls, key, b, 1, nv, dev).codes)))
        window = sampler(name, u + 1 - w0, u - w0, **kw).generate(ShiftedTime(model, w0), out[:, w0 * L:(u + 1) * L])[0]
        out[:, u * L:u * L + hw] = window[:, -L:-L + hw]
    monkeypatch.undo()
    return out


def windowed(model, s: ScheduleSampler, clip: torch.Tensor) -> torch.Tensor:
    """The reference for any depth and any d: the whole clip's schedule on a cache of every slot, each row seeing
    only its window (`Schedule.plan(window=C)`), noise keyed by slot as in generate()."""
    sched = Schedule.of(LAYOUT, N, s.config)
    s._open_cache(model, clip.shape[0], sched.n_slots + 1, True, clip.device)
    noise = SlotNoise.of(seed_key(s.seed), clip.shape[0], sched.n_slots + 1, V, clip.device)
    rule = SamplingRule.of(s.temperature, s.top_k, s.top_p, None, clip.device)
    out = clip.clone()
    for p in sched.plan(s.full, clip.device, window=C):
        logits = forward_rows(model, out, p)
        if p.n_out:
            out[:, p.out_slots] = sample_slots(logits, p.out_slots, noise, rule)
    return out


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("name", ["ntp", "diagd"])
def test_rollout_equals_reprefilling_the_window_before_every_frame(name, sampling, monkeypatch):
    """One layer (its keys are a function of token and position alone, so re-prefilling a window recomputes exactly
    the keys the rolling cache kept): N frames on a cache of C, eager and static, equal the re-prefilled ones."""
    model, clip, kw = tiny(1), clip_for(LAYOUT, N), SAMPLING[sampling]
    ref = reprefilled(model, name, clip, monkeypatch, **kw)
    for static in (False, True):
        s = sampler(name, context=C, static=static, **kw)
        tokens, stats = s.generate(model, clip)
        assert torch.equal(tokens, ref), (name, sampling, static)
        assert stats.passes == s.schedule().passes  # d = s_spa: no pass more than the clip's schedule
    assert not torch.equal(ref, sampler(name, **kw).generate(model, clip)[0])  # the window mattered


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("name,kw", [("ntp", {}), ("diagd", {}), ("diagd_overlap", dict(d=3)),
                                     ("diagd_above", dict(k=1, d=2, proxy="above")),
                                     ("diagd_prompt_proxy", dict(d=5, proxy="prompt"))])
def test_rollout_equals_the_windowed_schedule(model, name, kw, sampling):
    """Two layers, frames in flight at once (d < s_spa): the ring of C + in_flight - 1 frames, its periodic passes
    and its static padding give the tokens of the whole clip's schedule under the window rule on a full cache."""
    kw = {**kw, **SAMPLING[sampling]}
    clip = clip_for(LAYOUT, N)
    k = kw.pop("k", 2)
    eager = ScheduleSampler.ntp(LAYOUT, N, 1, context=C, **kw) if name == "ntp" else \
        ScheduleSampler(LAYOUT, N, 1, k=k, context=C, **kw)
    static = ScheduleSampler.ntp(LAYOUT, N, 1, context=C, static=True, **kw) if name == "ntp" else \
        ScheduleSampler(LAYOUT, N, 1, k=k, context=C, static=True, **kw)
    a, b = eager.generate(model, clip)[0], static.generate(model, clip)[0]
    assert torch.equal(a, windowed(model, eager, clip)) and torch.equal(a, b)
    plan = eager.rolling_schedule("cpu")
    assert plan.ring == C + plan.in_flight - 1 and (plan.in_flight > 1) == (name.count("_") > 0)


@pytest.mark.parametrize("sampling", SAMPLING)
def test_split_kv_rollout_equals_the_unsplit_one(model, sampling, monkeypatch):
    """Sampler.kv_splits=3: every cached pass of a rolling rollout reads the ring in 3 slices (flash-decoding) and
    gives the tokens of one attention call, eager and static."""
    clip = clip_for(LAYOUT, N)
    for static in (False, True):
        one = sampler("diagd", context=C, static=static, **SAMPLING[sampling]).generate(model, clip)[0]
        split = sampler("diagd", context=C, static=static, kv_splits=3, **SAMPLING[sampling])
        assert torch.equal(split.generate(model, clip)[0], one), static
        assert model.kv_splits == 3
    # two rollouts on one model (play's groups): each advance reads the keys in its own rollout's slices
    a = sampler("diagd", context=C, kv_splits=3).rollout(model, clip[:, :LAYOUT.frame_len])
    caches = model.swap_caches(None)
    sampler("diagd", context=C, kv_splits=1).rollout(model, clip[:, :LAYOUT.frame_len])
    assert model.kv_splits == 1
    model.swap_caches(caches)
    a.advance(clip[:, LAYOUT.frame_tokens:LAYOUT.frame_len])
    assert model.kv_splits == 3
    with pytest.raises(ValueError, match="kv_splits=0 is invalid"):
        sampler("diagd", kv_splits=0)
    auto = sampler("diagd")
    assert auto.kv_splits_for(1, 2, "cpu") == 1  # auto: one call on CPU
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("H100", (), {"multi_processor_count": 132}))
    # on an H100: one player of the 700m (32 KV heads) 4 slices, 16 players 1, a GQA model's one player 8 (the cap)
    assert [auto.kv_splits_for(b, h, "cuda") for b, h in ((1, 32), (16, 32), (1, 1))] == [4, 1, 8]
    # a rollout split off (play's games leaving a group) takes its own width's slices
    monkeypatch.setattr(sampler_mod.ScheduleSampler, "kv_splits_for", lambda self, batch, heads, device: 5 - batch)
    b = sampler("diagd", context=C).rollout(model, clip[:, :LAYOUT.frame_len])
    assert b.kv_splits == 5 - len(clip) and b.split([0]).kv_splits == 4


def test_rollout_steps_one_frame_per_action(model):
    """The play API: a Rollout advanced one action at a time returns each frame as soon as it is complete (after
    in_flight - 1 advances) and, finished, the frames generate() gives; it runs on past any clip length."""
    clip = clip_for(LAYOUT, N)
    L, hw = LAYOUT.frame_len, LAYOUT.frame_tokens
    s = sampler("diagd", context=C, d=3, seed=1)
    whole = s.generate(model, clip)[0]
    run = s.rollout(model, clip[:, :L])
    frames = [run.advance(clip[:, (u - 1) * L + hw:u * L]) for u in range(1, N)]
    assert run.plan.in_flight == 3 and frames[:2] == [None, None] and run.frames_done == N - 2
    frames = frames[2:] + run.finish()
    assert torch.equal(torch.stack(frames, 1), whole.view(2, N, L)[:, 1:, :hw])
    for _ in range(40):  # far past the reference clip the plans were taken from
        frame = run.advance(clip[:, hw:L])
    assert frame.shape == (2, hw) and int(frame.max()) < V
    s.generate(model, clip)  # opens the model's cache again: the rollout refuses to go on with it
    with pytest.raises(RuntimeError, match="reopened"):
        run.advance(clip[:, hw:L])


def test_rolling_static_step_compiles_once_for_every_frame(model, monkeypatch):
    """Long rollouts stay on the compiled path: shifted passes keep their bucket's shapes (dynamo with a counting
    backend, fullgraph: a graph break raises), so 20 more frames compile nothing new."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    monkeypatch.setattr(compiling, "CPU_COMPILE_OPTIONS", dict(backend=counter, fullgraph=True, dynamic=True))
    clip = clip_for(LAYOUT, N)
    s = sampler("diagd", context=C, d=3, seed=2, compile=True, static_widths=1)  # one width: fewer traces
    assert torch.equal(s.generate(model, clip)[0], sampler("diagd", context=C, d=3, seed=2).generate(model, clip)[0])
    before = counter.frame_count
    run = s.rollout(model, clip[:, :LAYOUT.frame_len])
    for _ in range(20):
        run.advance(clip[:, LAYOUT.frame_tokens:LAYOUT.frame_len])
    assert counter.frame_count == before and sampler_mod._sample_rolling_pass in s._compiled
    torch._dynamo.reset()


def test_static_rollout_passes_are_staged_at_fixed_addresses_with_nothing_built_per_frame(model, monkeypatch):
    """Past the warm-up every pass the static (compiled) step takes reads its inputs from one set of
    tensors per pass shape, marked static (CUDA graphs copy any other input at every replay), the mask already the
    attention bias, and no tensor is made on the host per pass (torch.tensor: a host-to-device copy and a host sync
    per pass on CUDA); the tokens equal the eager rollout's far past the reference clip."""
    from torch._dynamo.utils import get_static_address_type

    clip = clip_for(LAYOUT, N)
    L, hw = LAYOUT.frame_len, LAYOUT.frame_tokens
    eager = sampler("diagd", context=C, d=3, seed=4).rollout(model, clip[:, :L])
    static = sampler("diagd", context=C, d=3, seed=4, static=True).rollout(copy.deepcopy(model), clip[:, :L])
    seen, made, step, inputs = [], [], static.step, set()

    def record(model, tokens, p, *args):
        assert all(get_static_address_type(t) is not None for t in p) and p.mask.dtype == torch.float32
        rows, first_slots, codes, rule = args  # codes, temperature: held by the sampler; tokens, row keys, first
        # slots: kept on the rollout's KV cache set
        assert all(get_static_address_type(t) is not None for t in (tokens, rows, first_slots, codes))
        assert rule.temperature is None or get_static_address_type(rule.temperature) is not None
        seen.append(tuple(t.data_ptr() for t in p))
        inputs.add((tokens.data_ptr(), rows.data_ptr(), first_slots.data_ptr()))
        return step(model, tokens, p, *args)

    static.step = record
    for a in range(30):
        frame = eager.advance(clip[:, hw:L])
        if a > len(static.plan.warmup):  # steady state: count what the host makes per pass
            monkeypatch.setattr(torch, "tensor", lambda *x, _t=torch.tensor, **k: made.append(1) or _t(*x, **k))
        mine = static.advance(clip[:, hw:L])
        monkeypatch.undo()
        assert frame is None and mine is None or torch.equal(frame, mine)
    assert not made and len(set(seen)) == len({t[0] for t in seen}) <= 3  # one address set per pass shape
    assert len(inputs) == 1


def test_rolling_settings_are_checked():
    with pytest.raises(ValueError, match="sampler.context=1"):
        sampler("diagd", context=1)
    assert not sampler("diagd", frames=C, context=C).rolls()  # within the context: the plain schedule


@pytest.mark.skipif(not (REPO / "checkpoints/shipped/crafter_tiles_diagd/last.ckpt").exists(),
                    reason="the shipped checkpoint is not in this checkout")
def test_generate_rolls_past_the_checkpoints_clip_length(tmp_path):
    """Mcar generate frames=N on the shipped model (trained on 3-frame clips): the window defaults to the
    checkpoint's clip_frames, every frame costs the schedule's d passes, the ground truth's actions drive it."""
    from mcar.tools.generate import generate

    cfg = compose("generate", ["ckpt=checkpoints/shipped/crafter_tiles_diagd", "data=crafter_tiles", "frames=4",
                               "threads=1", f"paths.output_dir={tmp_path}"])
    res = generate(cfg)
    saved = torch.load(tmp_path / "clip0_diagd.pt")
    assert res["passes"] == 3 * 50 and res["passes_per_frame"] == 50  # s_spa = 13*2 + 24, one frame in flight
    assert saved["generated"].shape == (1, 4 * 337) and res["gif"].stat().st_size > 0
