"""docs/diagd.md section 6: the teacher-forced samplers compute exactly the one-pass masked forward's logits.

Tiny random float32 models; every comparison is a max relative error against 1e-4.
"""
import pytest
import torch
from omegaconf import OmegaConf

from mcar.checkpoint.config import packaged_group_config
from mcar.core.keyed_rng import keyed_exponential
from mcar.core.layout import Layout
from mcar.core.masks import IGNORE, CausalMask, DiagDMask, build_mask_factory, next_token_targets
from mcar.core.model import ModelConfig, Transformer
from mcar.core.sampler import ScheduleSampler, build_sampler, filtered_probs
from mcar.core.visibility import SlotTable


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None, key: torch.Tensor | None = None) -> torch.Tensor:
    """Test helper: logits (..., V) -> token ids (...) with the samplers' filters; temperature 0 or top_k 1 is
    greedy. key (...) int64: the noise of each row is `keyed_exponential(key)` (the samplers' draw); without it the
    noise comes from `generator`. An exponential race is multinomial sampling (gpt-fast)."""
    if temperature <= 0 or top_k == 1:
        return logits.argmax(-1)
    probs = filtered_probs(logits, temperature, top_k, top_p if top_p is not None and top_p < 1.0 else None)
    if key is not None:
        race = keyed_exponential(key, probs.shape[-1])
    else:
        race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(-1)


def diagd_val_loss(model, sampler: ScheduleSampler, clip: torch.Tensor, prompt_frames: int | None = None):
    """Test helper: the teacher-forced DiagD loss, mean cross-entropy over the generated image tokens."""
    return sampler.teacher_forced(model, clip, prompt_frames, keep_logits=False).nll.mean()


V, T, TOL = 32, 4, 1e-4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=96, init_std=0.2)
    return Transformer(cfg).eval()


def clip_for(layout, frames=T, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (batch, layout.n_slots(frames)), generator=g)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def masked_logits(model, factory, clip):
    """One parallel forward over the factory's sequence -> (B, N, V) logits indexed by the slot predicted."""
    batch = factory(clip)
    with torch.no_grad():
        logits = model(batch.tokens, batch.coords, batch.mask)  # (B, S, V)
    rows = getattr(factory, "predictor_row", torch.arange(clip.shape[1]) - 1)  # causal: slot p-1 predicts p
    return logits[:, rows]


@pytest.mark.parametrize("n_a", [0, 2])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("d", [None, 3])  # spatial-only (s_spa) and overlapping
@pytest.mark.parametrize("proxy", ["prev_frame", "above", "prompt"])
@pytest.mark.parametrize("full", [False, True])
def test_diagd_parity(model, n_a, k, d, proxy, full):
    layout, frames = Layout(3, 4, n_a), 3  # frames 1 and 2 overlap when d < s_spa
    clip = clip_for(layout, frames)
    if full and d is not None:  # full visibility with overlapping frames would show frame t the action a[t]
        with pytest.raises(ValueError, match="schedule.full=true needs d = s_spa"):
            DiagDMask(layout, frames, k=k, d=d, proxy=proxy, full=full)
        with pytest.raises(ValueError, match="schedule.full=true needs d = s_spa"):
            ScheduleSampler(layout, frames, 1, k=k, d=d, proxy=proxy, full=full)
        return
    mask = DiagDMask(layout, frames, k=k, d=d, proxy=proxy, full=full)
    tf = ScheduleSampler(layout, frames, 1, k=k, d=d, proxy=proxy, full=full).teacher_forced(model, clip)
    assert tf.logits.shape == (2, (frames - 1) * 12, V)
    assert rel_err(tf.logits, masked_logits(model, mask, clip)[:, tf.slots]) < TOL


@pytest.mark.parametrize("n_a", [0, 2])
@pytest.mark.parametrize("prompt_frames", [1, 2])
def test_ntp_parity_with_causal(model, n_a, prompt_frames):
    layout = Layout(3, 4, n_a)
    clip = clip_for(layout)
    tf = ScheduleSampler.ntp(layout, T, prompt_frames).teacher_forced(model, clip)
    assert rel_err(tf.logits, masked_logits(model, CausalMask(layout, T), clip)[:, tf.slots]) < TOL


@pytest.mark.parametrize("k, d", [(2, None), (1, 2), (6, None)])  # k > w: idle passes, no proxies
def test_diagd_parity_with_more_prompt_frames(model, k, d):
    layout = Layout(3, 4, 2)
    clip = clip_for(layout)
    mask = DiagDMask(layout, T, k=k, d=d, prompt_frames=2)
    tf = ScheduleSampler(layout, T, 2, k=k, d=d).teacher_forced(model, clip)
    assert len(tf.slots) == 2 * 12
    assert rel_err(tf.logits, masked_logits(model, mask, clip)[:, tf.slots]) < TOL


def test_parity_is_sensitive(model):
    """The comparisons above can fail: other masks, proxies or an off-by-one feed pass give other logits."""
    layout = Layout(3, 4, 2)
    clip = clip_for(layout)
    tf = ScheduleSampler(layout, T, 1, k=2, d=3).teacher_forced(model, clip)
    for other in [DiagDMask(layout, T, k=2, d=3, proxy="prompt"), DiagDMask(layout, T, k=2, d=3, proxy="above"),
                  CausalMask(layout, T)]:
        assert rel_err(tf.logits, masked_logits(model, other, clip)[:, tf.slots]) > 1e-2
    # F = G for generated image tokens (an input fed in the pass that samples it)
    mask = DiagDMask(layout, T, k=2, d=3)
    s = mask.schedule
    gen_rows = ~s.seq_is_proxy & s.generated[s.seq_pos]
    wrong = SlotTable(s.seq_feed_pass - gen_rows.long(), s.seq_pos, s.seq_is_proxy)
    batch = mask(clip)
    with torch.no_grad():
        logits = model(batch.tokens, batch.coords, wrong.dense())[:, s.predictor_row[tf.slots]]
    assert rel_err(tf.logits, logits) > 1e-2


@pytest.mark.parametrize("n_a, d", [(2, None), (0, None), (2, 12)])  # d = s_spa = h*w, or null
def test_diagd_with_k_equal_w_is_ntp(model, n_a, d):
    layout = Layout(3, 4, n_a)
    clip = clip_for(layout)
    s_spa = layout.h * layout.w
    diag = ScheduleSampler(layout, T, 1, k=layout.w, d=d, top_k=1)
    ntp = ScheduleSampler.ntp(layout, T, 1, top_k=1)
    assert diag.schedule().passes == ntp.schedule().passes == (T - 1) * s_spa
    tok_d, stats_d = diag.generate(model, clip)
    tok_n, stats_n = ntp.generate(model, clip)
    assert torch.equal(tok_d, tok_n) and stats_d.passes == stats_n.passes
    assert rel_err(diag.teacher_forced(model, clip).logits, ntp.teacher_forced(model, clip).logits) < TOL


def test_greedy_generation_is_teacher_forced_on_its_own_output(model):
    """Greedy tokens are the argmax of the teacher-forced logits on the generated clip."""
    layout = Layout(3, 4, 2)
    sampler = ScheduleSampler(layout, T, 1, k=2, d=3, temperature=0)
    tokens, stats = sampler.generate(model, clip_for(layout))
    tf = sampler.teacher_forced(model, tokens)
    assert torch.equal(tf.logits.argmax(-1), tokens[:, tf.slots])
    assert stats.passes == sampler.schedule().passes and stats.tokens == 2 * 3 * 12


def test_generation_reads_only_the_prompt_and_actions(model):
    layout = Layout(3, 4, 2)
    a, b = clip_for(layout, seed=1), clip_for(layout, seed=2)
    keep = ~ScheduleSampler(layout, T, 2, k=2).schedule().generated
    b[:, keep] = a[:, keep]  # same prompt frames and actions, other (ignored) image tokens
    sampler = ScheduleSampler(layout, T, 2, k=2, top_k=8, top_p=0.9, temperature=0.8, seed=3)
    out_a, _ = sampler.generate(model, a)
    out_b, _ = sampler.generate(model, b)
    assert torch.equal(out_a, out_b)  # seeded, and blind to the non-prompt image tokens
    assert torch.equal(out_a[:, keep], a[:, keep])
    assert not torch.equal(out_a[:, ~keep], a[:, ~keep])


@pytest.mark.parametrize("k, d", [(2, 3), (4, None)])
def test_nan_poisoned_cache_never_reaches_logits(model, k, d):
    layout = Layout(3, 4, 2)
    clip = clip_for(layout)
    sampler = ScheduleSampler(layout, T, 1, k=k, d=d)
    clean = sampler.teacher_forced(model, clip)
    model.setup_cache(2, layout.n_slots(T) + 1)
    for layer in model.layers:
        layer.attention.cache.k.fill_(float("nan"))
        layer.attention.cache.v.fill_(float("nan"))
    poisoned = sampler.teacher_forced(model, clip, setup_cache=False)
    assert torch.isfinite(poisoned.logits).all()
    assert rel_err(poisoned.logits, clean.logits) < TOL
    with pytest.raises(ValueError, match="setup_cache=False"):
        sampler.teacher_forced(model, clip[:1], setup_cache=False)


@pytest.mark.parametrize("factory", ["diagd", "diagd_full"])
def test_dense_mask_equals_block_mask(model, factory):
    layout = Layout(3, 4, 2)
    clip = clip_for(layout, frames=3)
    mask = build_mask_factory(factory, layout, 3, k=2, d=None if factory == "diagd_full" else 3, backend="flex")
    batch = mask(clip)
    table = mask.table()
    with torch.no_grad():
        dense = model(batch.tokens, batch.coords, table.dense())
        assert rel_err(model(batch.tokens, batch.coords, batch.mask), dense) < TOL
        assert rel_err(model(batch.tokens, batch.coords, table.block_mask(block_size=16)), dense) < TOL


def test_mask_factory_targets_and_inputs():
    layout = Layout(3, 4, 2)
    clip = clip_for(layout)
    mask = DiagDMask(layout, T, k=2)
    s, batch = mask.schedule, mask(clip)
    S = s.n_slots + (T - 1) * (layout.h - 1)
    assert batch.tokens.shape == batch.targets.shape == (2, S) and batch.mask.shape == (S, S)
    px = s.seq_is_proxy.nonzero().squeeze(1)
    assert torch.equal(batch.targets[:, px], clip[:, s.proxy_target])  # a proxy carries its row start's loss
    assert (batch.targets[:, s.row_of_slot[s.proxy_target - 1]] == IGNORE).all()  # the real predecessor: none
    assert torch.equal(batch.tokens[:, px], clip[:, s.proxy_target - layout.frame_len])  # prev_frame content
    assert torch.equal(batch.coords[px], s.coords[s.proxy_target - 1])
    n_loss = (batch.targets[0] != IGNORE).sum()
    assert n_loss == (next_token_targets(clip, layout, T, False)[0] != IGNORE).sum()
    assert mask(clip).mask is batch.mask  # built once per schedule


def test_plain_variant_has_no_proxy_slots(model):
    layout = Layout(3, 4, 2)
    clip = clip_for(layout)
    plain = DiagDMask(layout, T, k=2, proxy_slots=False)
    batch = plain(clip)
    assert batch.tokens.shape == clip.shape and torch.equal(batch.tokens, clip)
    assert torch.equal(batch.targets, next_token_targets(clip, layout, T, False))
    assert batch.mask.sum() < CausalMask(layout, T).table().dense().sum()  # a strict subset of causal
    # with k = w no proxy is needed and the plain variant is parity-exact too
    tf = ScheduleSampler(layout, T, 1, k=4).teacher_forced(model, clip)
    exact = DiagDMask(layout, T, k=4, proxy_slots=False)
    assert rel_err(tf.logits, masked_logits(model, exact, clip)[:, tf.slots]) < TOL


def test_configs_build_and_validation_loss(model):
    layout = Layout(3, 4, 2)
    clip = clip_for(layout)
    schedule = OmegaConf.to_container(OmegaConf.load("conf/schedule/diagd.yaml"))
    for full in (False, True):
        cfg = OmegaConf.to_container(OmegaConf.load("conf/mask/diagd.yaml"))
        mask = build_mask_factory(cfg.pop("name"), layout, T, schedule=schedule | {"full": full}, **cfg)
        assert mask.name == ("diagd_full" if full else "diagd") and mask.schedule.k == schedule["k"]
    ntp = build_sampler(packaged_group_config("sampler", "ntp"), layout, T, schedule=schedule)
    diag = build_sampler(packaged_group_config("sampler", "diagd"), layout, T, schedule=schedule)
    assert ntp.name == "ntp" and diag.name == "diagd" and type(ntp) is type(diag) is ScheduleSampler
    loss = diagd_val_loss(model, diag, clip)
    tf = diag.teacher_forced(model, clip)
    ref = torch.nn.functional.cross_entropy(tf.logits.flatten(0, 1), clip[:, tf.slots].flatten())
    assert abs(loss.item() - ref.item()) < 1e-5
    with pytest.raises(ValueError, match="sampler.name"):
        build_sampler({"name": "beam"}, layout, T)
    with pytest.raises(ValueError, match=r"sampler.k is a schedule setting: set schedule.k"):
        build_sampler({"name": "diagd", "k": 4}, layout, T)
    with pytest.raises(ValueError, match="top_p"):
        ScheduleSampler(layout, T, top_p=1.5)
    with pytest.raises(ValueError, match="k=0"):
        build_mask_factory("diagd", layout, T, k=0)


def test_sample_filters_and_seed():
    logits = torch.randn(3, 5, V)
    assert torch.equal(sample(logits, top_k=1), logits.argmax(-1))
    assert torch.equal(sample(logits, temperature=0), logits.argmax(-1))
    assert torch.equal(sample(logits, top_p=1e-6, generator=torch.Generator().manual_seed(0)), logits.argmax(-1))
    top4 = logits.topk(4, dim=-1).indices
    for seed in range(5):
        tok = sample(logits, top_k=4, generator=torch.Generator().manual_seed(seed))
        assert (top4 == tok[..., None]).any(-1).all()
    a = sample(logits, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, sample(logits, generator=torch.Generator().manual_seed(7)))


def test_batch_of_one(model):
    layout = Layout(3, 4, 2)
    tokens, stats = ScheduleSampler(layout, 3, 1, k=1, seed=0).generate(model, clip_for(layout, 3, batch=1))
    assert tokens.shape == (1, layout.n_slots(3)) and stats.tokens == 2 * 12 and stats.seconds > 0


@pytest.mark.parametrize("static", [False, True])
def test_image_slots_sample_image_codes_only(static):
    """An (undertrained) model that prefers action ids still writes only codes < codebook_size into frames."""
    torch.manual_seed(0)
    layout, cb = Layout(3, 4, 2), 24  # ids 24..31 are action tokens
    m = Transformer(ModelConfig(vocab_size=V, dim=32, n_layers=1, n_heads=4, mlp_dim=64)).eval()
    with torch.no_grad():
        m.output.weight[cb:] *= 50  # action ids dominate every position's logits
    clip = clip_for(layout)
    for cls in (ScheduleSampler.ntp, ScheduleSampler):
        unrestricted, _ = cls(layout, T, seed=0, static=static).generate(m, clip)
        restricted, _ = cls(layout, T, seed=0, static=static, codebook_size=cb).generate(m, clip)
        gen = cls(layout, T).schedule().gen_slots
        assert (unrestricted[:, gen] >= cb).any()  # the test would see a missing restriction
        assert (restricted[:, gen] < cb).all()
        rest = torch.ones(clip.shape[1], dtype=torch.bool)
        rest[gen] = False
        assert torch.equal(restricted[:, rest], clip[:, rest])  # prompt and actions untouched
    assert build_sampler({"name": "ntp"}, layout, T, codebook_size=cb).codebook_size == cb
    with pytest.raises(ValueError, match="codebook_size"):
        ScheduleSampler(layout, T, codebook_size=0)


def test_causal_mask_is_sdpa_is_causal_on_cpu(model):
    """The causal factory hands SDPA no mask (is_causal: the fast kernel); it must equal its own dense table."""
    layout = Layout(3, 4, 2)
    clip = clip_for(layout)
    factory = CausalMask(layout, T)
    batch = factory(clip)
    assert batch.mask is None
    dense = factory.table().dense()
    assert torch.equal(dense, torch.ones_like(dense).tril())
    with torch.no_grad():
        assert rel_err(model(batch.tokens, batch.coords, None), model(batch.tokens, batch.coords, dense)) < TOL


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_likeliest():
    """min-p (Nguyen et al. 2024) after temperature: the oracle computes it from the probabilities, the filter from
    the logits; a sampler with min_p draws only kept tokens, its label says so, and a bad value is refused."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, V, generator=g) * 3
    for min_p, temp in ((0.1, 1.0), (0.5, 0.7), (0.999, 1.3)):
        p = (logits / temp).softmax(-1)
        keep = p >= min_p * p.max(-1, keepdim=True).values
        got = filtered_probs(logits, temp, None, None, min_p)
        assert torch.equal(got > 0, keep)
        assert torch.allclose(got, torch.where(keep, p, 0) / torch.where(keep, p, 0).sum(-1, keepdim=True))
    layout = Layout(3, 4, 2)
    model = Transformer(ModelConfig(vocab_size=V, dim=48, n_layers=2, n_heads=4, mlp_dim=96, init_std=2.0)).eval()
    sampler = ScheduleSampler(layout, T, 1, k=2, min_p=0.5, seed=1)
    assert sampler.label == "diagd k=2 min_p=0.5"
    tokens, _ = sampler.generate(model, clip_for(layout))
    tf = sampler.teacher_forced(model, tokens)  # each drawn token passed the filter at the logits it was drawn from
    probs = tf.logits.softmax(-1)
    drawn = probs.gather(-1, tokens[:, tf.slots, None]).squeeze(-1)
    assert (drawn >= 0.5 * probs.max(-1).values * (1 - 1e-5)).all()
    with pytest.raises(ValueError, match="min_p=1.5 is invalid"):
        ScheduleSampler(layout, T, min_p=1.5)


def test_play_starts_greedy_and_samples_under_min_p_above_it():
    """mcar play's page: greedy at start; above temperature 0 its games draw under min-p 0.1 (the rule that won at
    temperature 1 on every world-test player)."""
    from mcar.hydra_app import compose_tool

    cfg = compose_tool("play", [])
    assert cfg.sampler.temperature == 0 and cfg.sampler.min_p == 0.1
    layout = Layout(3, 4, 2)
    rule = ScheduleSampler(layout, T, 1, k=2, **{k: cfg.sampler[k] for k in ("min_p", "top_p", "top_k")},
                           temperature=1.0).sampling_rule("cpu")
    assert rule.min_p is not None and float(rule.min_p) == pytest.approx(0.1)
