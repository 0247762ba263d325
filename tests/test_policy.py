"""Post-training's exactness (mcar.core.policy): the log-probabilities the trainer computes for a sampled rollout in
one forward pass equal the ones the sampler drew its tokens from (float64 models), NTP and DiagD, eager and static,
on a rollout longer than the context (the rolling window); and GRPO's advantages and loss on hand-made cases."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mcar.core.layout import Layout
from mcar.core.model import ModelConfig, Transformer
from mcar.core.policy import RolloutScorer, group_advantages, grpo_loss
from mcar.core.sampler import SamplingRule, ScheduleSampler, token_logprobs

from .test_parity import clip_for

V, CB, N, C = 32, 24, 6, 3  # vocabulary, image codes, frames (prompt included), context: N > C rolls
LAYOUT = Layout(3, 4, 2)


def tiny(seed: int) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=64, init_std=0.2)
    return Transformer(cfg).double().eval()


def sampler(name: str, **kw) -> ScheduleSampler:
    kw = dict(context=C, codebook_size=CB, seed=3, top_k=20, **kw)
    if name == "ntp":
        return ScheduleSampler.ntp(LAYOUT, N, 1, **kw)
    return ScheduleSampler(LAYOUT, N, 1, k=2, **kw)


@pytest.mark.parametrize("name,kw", [("ntp", {}), ("diagd", {}), ("diagd_overlap", dict(d=3))])
def test_trainer_logprobs_equal_the_samplers(name, kw):
    """A rollout of N > C frames, drawn with its log-probabilities recorded pass by pass (eager and static: the
    same tokens and values), scored by RolloutScorer in one pass: equal to float64 rounding; the reference model's
    likewise equal its own sampler's (the teacher-forced passes of the same rollout)."""
    policy, reference = tiny(0), tiny(1)
    clip = clip_for(LAYOUT, N)
    eager = sampler(name, **kw).roll(policy, clip, noise_keys=torch.tensor([7, 8]), logprobs=True)
    static = sampler(name, static=True, **kw).roll(policy, clip, noise_keys=torch.tensor([7, 8]), logprobs=True)
    assert torch.equal(eager.tokens, static.tokens)
    torch.testing.assert_close(eager.logprobs, static.logprobs, rtol=0, atol=1e-10)
    s = sampler(name, **kw)
    rule = SamplingRule.of(1.0, 20, None, CB, "cpu")
    scorer = RolloutScorer(LAYOUT, N, s.config, context=C)
    gen = scorer.generated_mask()
    assert bool((eager.logprobs[:, ~gen] == 0).all()) and bool((eager.logprobs[:, gen] < 0).all())
    trainer = scorer(policy, eager.tokens, rule)
    assert trainer.dtype == torch.float64
    torch.testing.assert_close(trainer, eager.logprobs, rtol=0, atol=1e-10)
    # the reference: its own sampler run teacher-forced on the drawn tokens (the rolling passes, tokens forced)
    forced = _teacher_forced_rolling(s, reference, eager.tokens, rule)
    torch.testing.assert_close(RolloutScorer(LAYOUT, N, s.config, context=C)(reference, eager.tokens, rule), forced,
                               rtol=0, atol=1e-10)
    # the window mattered: scored on the whole clip, the same tokens get other log-probabilities
    assert not torch.allclose(RolloutScorer(LAYOUT, N, s.config)(policy, eager.tokens, rule), trainer, atol=1e-6)


def _teacher_forced_rolling(s: ScheduleSampler, model, tokens: torch.Tensor, rule) -> torch.Tensor:
    """The rollout's passes on the ring with the given tokens written instead of drawn: float64 end to end."""
    plan = s.rolling_schedule("cpu")
    L, hw, P = LAYOUT.frame_len, LAYOUT.frame_tokens, plan.prompt_frames
    run = s.rollout(model, tokens[:, :P * L])
    out = torch.zeros(tokens.shape, dtype=torch.float64)

    def forced(p):  # ring column -> slot of the open-ended clip: p.out_abs
        logits = model(run.tokens[:, p.src], p.coords, p.mask, p.cache_pos)[:, p.out_rows]
        real = p.out_abs < tokens.shape[1]
        abs_slots = p.out_abs.clamp(max=tokens.shape[1] - 1)
        drawn = torch.where(real, tokens[:, abs_slots], 0)  # a frame past the clip's end: never shown
        out[:, abs_slots[real]] = token_logprobs(logits, drawn, rule)[:, real]
        run.tokens[:, p.out_slots] = drawn

    for a in range(N - P + plan.in_flight - 1):
        u = P + a
        if u - 1 < N:
            start = plan.column(u - 1) + hw
            run.tokens[:, start:start + LAYOUT.n_a] = tokens[:, (u - 1) * L + hw:u * L]
        with torch.no_grad():
            if a == 0:
                forced(plan.prefill)
            for p in plan.passes(a):
                forced(p)
    return out


def test_greedy_has_no_logprobs():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), SamplingRule())


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=8, max_size=8), st.sampled_from([2, 4]))
def test_group_advantages_are_normalised_within_each_group(rewards, group):
    r = torch.tensor(rewards, dtype=torch.float64)
    adv = group_advantages(r, group).view(-1, group)
    assert torch.allclose(adv.sum(1), torch.zeros(len(adv), dtype=torch.float64), atol=1e-6)
    shifted = group_advantages(r + torch.arange(len(r) // group).repeat_interleave(group) * 10.0, group)
    assert torch.allclose(shifted, adv.flatten(), atol=1e-6)  # a per-group offset changes nothing


def test_grpo_loss_pushes_up_the_better_rollout_and_clips():
    logp = torch.zeros(2, 3, requires_grad=True)
    old = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    out = grpo_loss(logp, old, old, adv, torch.tensor([True, True, False]))
    out.loss.backward()
    assert (logp.grad[0, :2] < 0).all() and (logp.grad[1, :2] > 0).all() and (logp.grad[:, 2] == 0).all()
    assert out.kl == 0 and out.clip_fraction == 0 and out.ratio == 1
    # a ratio far above 1 + eps on a positive advantage is clipped: no gradient, counted
    far = grpo_loss(torch.full((1, 2), 1.0, requires_grad=True), torch.zeros(1, 2), None, torch.tensor([1.0]),
                    torch.tensor([True, True]))
    assert far.clip_fraction == 1
    # the KL anchor: the k3 estimate is 0 at the reference and positive away from it
    assert grpo_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.full((1, 2), -0.5), torch.tensor([0.0]),
                     torch.tensor([True, True])).kl > 0
