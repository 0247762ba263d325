"""Post-training (`mcar posttrain`, mcar.train.posttrain): the reward terms on frames built to differ, GRPO learning a
reward on a tiny model (the gradient's sign end to end: sampler, one-pass scorer, loss), the starts' world seeds,
and the command on the shipped world model: rollouts past the context, checkpoints a sampler loads, resume."""
from pathlib import Path

import pytest
import torch

from mcar.core.layout import Layout
from mcar.core.model import ModelConfig, Transformer
from mcar.core.policy import RolloutScorer, group_advantages, grpo_loss
from mcar.core.sampler import SamplingRule, ScheduleSampler
from mcar.crafter.rewards import CreatureCount, CreatureTolerantAgreement
from mcar.data.starts import StepStarts
from mcar.idm.model import InverseDynamics, save_idm
from mcar.train.posttrain import reward_terms
from mcar.train.rewards import ActionMatch, NoInventedTiles, Rollouts, TileAgreement, TileMix

from .conftest import REPO, compose, run_in_process

LAYOUT, CB = Layout(3, 4, 1), 10
# PostTrainModule's arguments for a tiny model on LAYOUT: its `posttrain` node and the rest
TINY_POST = dict(group=2, rollout_frames=4, context=3, clip_eps=0.2, kl_coef=0.0,
                 rewards={"tiles": {"_target_": "mcar.train.rewards.TileAgreement", "weight": 1}})
TINY_MODULE = dict(arch=dict(vocab_size=CB + 4, dim=32, n_layers=1, n_heads=2, mlp_dim=64), layout=vars(LAYOUT),
                   clip_frames=3, mask={"name": "diagd"}, optim={}, max_steps=1, data={"codebook_size": CB},
                   sampler={"name": "diagd", "temperature": 1.0})


def clips_of(frames: list[list[int]], action: int = 2) -> torch.Tensor:
    """One clip per row: each frame all one code (a list of codes per frame)."""
    rows = []
    for codes in frames:
        rows.append(torch.cat([torch.cat([torch.full((LAYOUT.frame_tokens,), c), torch.tensor([CB + action])])
                               for c in codes]))
    return torch.stack(rows)


def test_tile_agreement_and_invented_tiles_score_what_they_say():
    real = clips_of([[1, 2, 3], [1, 2, 3]])
    gen = real.clone()
    gen[1, LAYOUT.frame_len * 2] = 9  # one tile of the last frame: a code in neither the real frame nor the prompt
    gen[0, LAYOUT.frame_len * 2] = 1  # one tile of the last frame: the prompt's code, not the real frame's
    r = Rollouts(gen, real, LAYOUT, CB, prompt_frames=1)
    n = 2 * LAYOUT.frame_tokens
    assert TileAgreement()(r).tolist() == pytest.approx([(n - 1) / n, (n - 1) / n])
    # rows: the first image row holds the changed tile, the rest of the frame agrees
    w = LAYOUT.w
    assert TileAgreement(rows=[0, 1])(r).tolist() == pytest.approx([(2 * w - 1) / (2 * w)] * 2)
    assert TileAgreement(rows=[1, None])(r).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="select none"):
        TileAgreement(rows=[5, 9])(r)
    assert NoInventedTiles()(r).tolist() == pytest.approx([1.0, (n - 1) / n])


def test_revisited_tiles_are_those_only_the_window_remembers():
    """revisited_mask against sets of world tiles per frame (an oracle of its own), on seeded random walks, and the
    term on a wait-then-return walk: only the column that came back counts."""
    import random

    from mcar.crafter.rewards import RevisitedTiles, revisited_mask

    rng = random.Random(0)
    for _ in range(20):
        T, context = rng.randint(2, 8), rng.randint(2, 6)
        pos = [(0, 0)]
        for _ in range(T - 1):
            dx, dy = rng.choice([(0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)])
            pos.append((pos[-1][0] + dx, pos[-1][1] + dy))
        views = [{(x + dc, y + dr) for dr in range(-3, 4) for dc in range(-4, 5)} for x, y in pos]
        got = revisited_mask(torch.tensor([pos]), 7, 9, context)[0]
        for t in range(T):
            remembered = set().union(*views[max(0, t - context + 1):max(0, t - 1)])
            want = [[(pos[t][0] + c - 4, pos[t][1] + r - 3) in remembered - (views[t - 1] if t else set())
                     for c in range(9)] for r in range(7)]
            assert got[t].tolist() == want, (pos, context, t)
    layout = Layout(9, 9, 1)
    wait = torch.tensor([[(0, 0), (1, 0), (1, 0), (1, 0), (0, 0)]])  # one out, two noops, one back
    mask = revisited_mask(wait, 7, 9, 6)[0]
    assert mask[:4].sum() == 0 and mask[4, :, 0].all() and mask[4].sum() == 7
    assert revisited_mask(wait, 7, 9, 4)[0].sum() == 0  # the start frame has left a 4-frame window
    real = torch.randint(0, CB, (1, 5, layout.frame_len))
    gen = real.clone()
    gen[0, 4, 0] = (real[0, 4, 0] + 1) % CB  # the came-back column's top tile wrong
    gen[0, 4, 1] = (real[0, 4, 1] + 1) % CB  # a tile memory cannot tell: not scored
    term = RevisitedTiles()
    r = Rollouts(gen.flatten(1), real.flatten(1), layout, CB, prompt_frames=1, positions=wait, context=6)
    assert term(r).tolist() == pytest.approx([6 / 7])
    with pytest.raises(ValueError, match="RevisitedTiles needs the player's positions"):
        term(Rollouts(gen.flatten(1), real.flatten(1), layout, CB, prompt_frames=1))


def test_tile_mix_pays_for_the_right_tiles_wherever_they_are_drawn():
    """A creature drawn one tile off keeps the mix (1) and loses agreement twice; one left out loses both once."""
    real = clips_of([[1, 2, 2]])
    real[0, LAYOUT.frame_len * 2 + 3] = 7  # a creature in the last frame
    off = real.clone()
    off[0, LAYOUT.frame_len * 2 + 3], off[0, LAYOUT.frame_len * 2 + 4] = 2, 7  # drawn one tile along
    left_out = real.clone()
    left_out[0, LAYOUT.frame_len * 2 + 3] = 2
    n, ft = 2 * LAYOUT.frame_tokens, LAYOUT.frame_tokens
    mix = lambda g: TileMix()(Rollouts(g, real, LAYOUT, CB, prompt_frames=1)).item()
    agree = lambda g: TileAgreement()(Rollouts(g, real, LAYOUT, CB, prompt_frames=1)).item()
    assert mix(real) == mix(off) == 1.0 and agree(off) == pytest.approx((n - 2) / n)
    assert mix(left_out) == pytest.approx(1 - 1 / ft / 2) and agree(left_out) == pytest.approx((n - 1) / n)


def test_creature_count_pays_for_creatures_drawn_in_number_wherever_they_are():
    term = CreatureCount(str(REPO / "mcar" / "assets" / "vq_crafter_tiles_all"))
    cow = int(term.codes[0])
    real = clips_of([[1, 2, 2]])
    real[0, LAYOUT.frame_len + 3] = cow  # frame 1: one creature; frame 2: none
    off = real.clone()
    off[0, LAYOUT.frame_len + 3], off[0, LAYOUT.frame_len + 5] = 2, cow  # drawn elsewhere
    left_out, extra = real.clone(), real.clone()
    left_out[0, LAYOUT.frame_len + 3] = 2
    extra[0, LAYOUT.frame_len * 2 + 7] = cow  # frame 2 gains one the game does not have
    score = lambda g: term(Rollouts(g, real, LAYOUT, CB, prompt_frames=1)).item()
    assert score(real) == score(off) == 1.0
    assert score(left_out) == score(extra) == 0.5  # one frame of two wrong by one creature


def test_creature_tolerant_agreement_forgives_a_creature_a_tile_off_and_nothing_else():
    """Plain agreement charges a creature drawn a tile off two tiles and one left out one; this term charges the
    first nothing, the second and a made-up one a tile each, a second drawn beside the first one tile, and a
    creature of another code or two tiles off both tiles, as agreement does."""
    term = CreatureTolerantAgreement(str(REPO / "mcar" / "assets" / "vq_crafter_tiles_all"))
    cow, other = int(term.codes[0]), int(term.codes[-1])
    at = lambda row, col: LAYOUT.frame_len * 2 + row * LAYOUT.w + col  # a tile of the last frame
    real = clips_of([[1, 2, 2]])
    real[0, at(1, 1)] = cow

    def drawn(*tiles, code=cow, keep=False):
        g = real.clone()
        g[0, at(1, 1)] = cow if keep else 2
        for row, col in tiles:
            g[0, at(row, col)] = code
        return g

    n = 2 * LAYOUT.frame_tokens
    score = lambda g: term(Rollouts(g, real, LAYOUT, CB, prompt_frames=1)).item()
    plain = lambda g: TileAgreement()(Rollouts(g, real, LAYOUT, CB, prompt_frames=1)).item()
    assert score(real) == 1.0 and score(drawn((1, 2))) == score(drawn((2, 2))) == 1.0  # a tile off, diagonal too
    assert plain(drawn((1, 2))) == pytest.approx((n - 2) / n)
    assert score(drawn()) == pytest.approx((n - 1) / n)  # left out
    assert score(drawn((1, 2), keep=True)) == pytest.approx((n - 1) / n)  # drawn right, and one more beside it
    assert score(drawn((1, 0), (1, 2))) == pytest.approx((n - 1) / n)  # two for one: only one is paired
    assert score(drawn((1, 3))) == plain(drawn((1, 3))) == pytest.approx((n - 2) / n)  # two tiles off
    assert other != cow and score(drawn((1, 2), code=other)) == pytest.approx((n - 2) / n)  # another's code
    with pytest.raises(ValueError, match="reach=-1"):
        CreatureTolerantAgreement(str(REPO / "mcar" / "assets" / "vq_crafter_tiles_all"), reach=-1)


def test_action_match_reads_the_idm_and_names_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="posttrain.rewards.action.idm"):
        ActionMatch(str(tmp_path / "none.pt"))
    torch.manual_seed(0)
    idm = InverseDynamics(CB, 1, 4, dim=4, hidden=8, max_shift=(1, 1))
    save_idm(idm.eval(), tmp_path / "idm.pt", {})
    real = clips_of([[1, 2, 3], [4, 5, 6]])
    score = ActionMatch(str(tmp_path / "idm.pt"))(Rollouts(real, real, LAYOUT, CB, 1))
    frames = real.view(2, 3, -1)[..., :LAYOUT.frame_tokens].view(2, 3, 3, 4)
    read = idm.eval().predict(frames[:, :2].flatten(0, 1), frames[:, 1:].flatten(0, 1)).view(2, 2)
    assert score.tolist() == pytest.approx((read == 2).float().mean(1).tolist())  # the commanded action: 2


def test_reward_terms_need_weights_and_one_that_counts():
    with pytest.raises(ValueError, match="rewards.tiles.weight"):
        reward_terms({"tiles": {"_target_": "mcar.train.rewards.TileAgreement"}})
    with pytest.raises(ValueError, match="no term has a non-zero weight"):
        reward_terms({"tiles": {"_target_": "mcar.train.rewards.TileAgreement", "weight": 0}})
    terms = reward_terms({"tiles": {"_target_": "mcar.train.rewards.TileAgreement", "weight": 1}, "action": None})
    assert [t.name for t in terms] == ["tiles"]


def test_starts_take_fresh_disjoint_worlds_per_step_and_rank_and_skip_deaths():
    class Worlds:
        dead = 0

        def __call__(self, seed):
            if seed % 5 == 0:  # the player died
                self.dead += 1
                return []
            return [(torch.full((3,), seed), torch.zeros(2, 2))] * 2  # two clips per world, their positions

    seen = []
    for step in range(3):
        for rank in range(2):
            item = StepStarts(Worlds(), 3, 100, rank, 2)[step]
            seen += sorted(set(item["world_seed"].tolist()))
            assert len(item["tokens"]) == 3 and all(s % 5 for s in item["world_seed"].tolist())
            assert item["positions"].shape == (3, 2, 2)
    assert len(seen) == len(set(seen)) == 12  # 2 worlds per step and rank (3 clips, 2 per world), never shared


def test_grpo_learns_a_reward_on_a_tiny_model():
    """The reward: the share of generated tokens equal to code 3. GRPO steps (DiagD rollouts on the rolling cache,
    log-probabilities from the one-pass scorer) raise it well above where it starts."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=CB + 4, dim=32, n_layers=1, n_heads=2, mlp_dim=64, init_std=0.02))
    frames, context, group = 4, 3, 4
    sampler = ScheduleSampler(LAYOUT, frames, 1, k=2, context=context, codebook_size=CB)
    scorer = RolloutScorer(LAYOUT, frames, sampler.config, context)
    rule = SamplingRule.of(1.0, None, None, CB, "cpu")
    gen = scorer.generated_mask()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    clips = clips_of([[1, 2, 3, 4]] * 2).repeat_interleave(group, 0)
    rewards = []
    for step in range(10):
        with torch.no_grad():
            rolled = sampler.roll(model, clips, noise_keys=torch.arange(len(clips)) + 100 * step, logprobs=True)
        model.swap_caches(None)
        reward = (rolled.tokens[:, gen] == 3).float().mean(1)
        rewards.append(float(reward.mean()))
        out = grpo_loss(scorer(model, rolled.tokens, rule), rolled.logprobs, None, group_advantages(reward, group),
                        gen, kl_coef=0.0)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert sum(rewards[:3]) / 3 < 0.2 and sum(rewards[-3:]) / 3 > 0.45, rewards


@pytest.mark.slow
def test_posttrain_runs_resumes_and_its_checkpoint_samples(tmp_path):
    """Two steps on the shipped world model, rollouts of 3 frames on a 2-frame window (they roll), then one more
    step resumed from last.ckpt: the rewards and the parity gap are logged, a rollout video written, and the
    checkpoint loads as any sampling tool's model."""
    from mcar.checkpoint.io import load_checkpoint
    from mcar.checkpoint.load import load_model
    from mcar.tools.posttrain import main

    common = ["init_from=" + str(REPO / "checkpoints/shipped/crafter_world/last.ckpt"), "logger=csv",
              f"paths.checkpoint_root={tmp_path}/ckpt", f"hydra.run.dir={tmp_path}/out", "posttrain.group=2",
              "posttrain.starts=1", "posttrain.rollout_frames=3", "sampler.context=2", "checkpoint.every_n_steps=1",
              "posttrain.video_every_n_steps=2", "log_every_n_steps=1", "run_name=pt", "starts.warmup=2",
              "optim.lr=1e-3",  # steps that move the weights: the next rollouts must see them
              # a term that needs the starts' player positions: they must reach it
              "+posttrain.rewards.revisited={_target_:mcar.crafter.rewards.RevisitedTiles,weight:0}"]
    run_in_process(main, *common, "steps=2")
    ckpt = tmp_path / "ckpt" / "pt" / "last.ckpt"
    state = load_checkpoint(ckpt)
    assert state["global_step"] == 2 and state["hyper_parameters"]["stage"] == "posttrain"
    from mcar.crafter.seeds import posttrain_worlds, seen_policies  # the world tests' checks read its worlds
    assert posttrain_worlds(state["hyper_parameters"]).start == 1000000
    assert seen_policies(state["hyper_parameters"]) == {"explorer", "random", "wanderer"}
    assert all(k.startswith("model.") for k in state["state_dict"])  # the reference is not in it
    metrics = (next(Path(tmp_path / "out" / "csv").rglob("metrics.csv"))).read_text()
    for key in ("reward/tiles", "reward/plausible", "reward/revisited", "train/kl", "train/clip_fraction",
                "train/logp_gap"):
        assert key in metrics
    import csv
    gaps = [float(r["train/logp_gap"]) for r in csv.DictReader(metrics.splitlines()) if r.get("train/logp_gap")]
    assert len(gaps) == 2 and max(gaps) < 1e-4, gaps  # step 2's rollouts drawn from the weights step 1 made
    assert (tmp_path / "out" / "rollouts" / "step0000002.gif").is_file()
    load_model(ckpt)  # generate, evaluate and play read it
    run_in_process(main, *common, "steps=3", "ckpt_path=last")
    assert load_checkpoint(ckpt)["global_step"] == 3


def test_the_supervised_control_is_the_samplers_loss_on_the_true_clips():
    """posttrain.objective=supervised: the same worlds' true clips teacher-forced on the rollout sampler's schedule
    and window, the mean negative log-probability of their generated tokens; an unknown objective is refused."""
    from mcar.train.posttrain import PostTrainModule

    post, kw = TINY_POST | {"objective": "supervised"}, TINY_MODULE
    module = PostTrainModule(post, **kw)
    clips = clips_of([[1, 2, 3, 4], [5, 6, 7, 8]])
    logp = module.scorer(module.model, clips, module.rule("cpu"))
    assert module.training_step({"tokens": clips}, 0).item() == pytest.approx(
        -logp[:, module.scorer.generated_mask()].mean().item())
    with pytest.raises(ValueError, match="posttrain.objective='ppo'"):
        PostTrainModule(post | {"objective": "ppo"}, **kw)


@pytest.mark.parametrize("cut", [{"min_p": 0.1}, {"top_p": 0.9}, {"top_k": 5}])
def test_post_training_refuses_a_rule_that_cuts_the_distribution(cut):
    """Under min_p / top_p / top_k a token drawn by the sampler can be cut by the updated model or the anchor: its
    log-probability is -inf and the loss NaN (seen at step 5 of a real run), so the rule is refused by name."""
    from mcar.train.posttrain import PostTrainModule

    sampler = TINY_MODULE["sampler"] | cut
    with pytest.raises(ValueError, match=f"sampler.{next(iter(cut))}=.*drop it here"):
        PostTrainModule(TINY_POST, **(TINY_MODULE | {"sampler": sampler}))


def test_the_runs_seed_picks_the_rollouts_noise_and_a_step_redraws_the_same():
    """posttrain.seed: another seed draws other rollouts from the same weights and worlds; the same seed and step
    draw the same (a resumed run)."""
    from mcar.train.posttrain import PostTrainModule

    clips = clips_of([[1, 2, 3, 4], [5, 6, 7, 8]])
    torch.manual_seed(0)
    module = PostTrainModule(TINY_POST, **TINY_MODULE)

    def drawn(seed: int) -> torch.Tensor:
        module.post["seed"] = seed
        return module.rollouts(clips, 3)["tokens"]

    first = drawn(0)
    assert not torch.equal(first, drawn(1)) and torch.equal(first, drawn(0))


def test_the_supervised_term_adds_the_true_clips_loss_to_grpos():
    """posttrain.supervised_coef: the GRPO loss plus that weight times the true clips' teacher-forced loss (the
    same rollouts: the noise keys are the step's); a negative weight is refused."""
    from mcar.train.posttrain import PostTrainModule

    post, kw = TINY_POST, TINY_MODULE
    clips = clips_of([[1, 2, 3, 4], [5, 6, 7, 8]])
    torch.manual_seed(0)
    alone = PostTrainModule(post, **kw)
    torch.manual_seed(0)
    mixed = PostTrainModule(post | {"supervised_coef": 0.5}, **kw)
    alone._logs_this_step = mixed._logs_this_step = False  # no trainer: no learning rate to log
    nll = mixed.true_clip_nll(clips)
    assert nll.item() > 0
    assert mixed.training_step({"tokens": clips}, 0).item() == pytest.approx(
        alone.training_step({"tokens": clips}, 0).item() + 0.5 * nll.item(), rel=1e-5)
    with pytest.raises(ValueError, match="posttrain.supervised_coef=-1.0"):
        PostTrainModule(post | {"supervised_coef": -1}, **kw)


def test_starts_play_recall_plans_and_placing_when_asked(monkeypatch):
    """starts.recall and starts.placing reach the policies (crafter_gen's settings, checked up front); null keeps
    today's policies, not the defaults that {} asks for; a placing wanderer places in the true clips."""
    from hydra.utils import instantiate

    import mcar.crafter.starts as starts
    from mcar.crafter.gen import ACTIONS, MOVE_DELTA, placing_settings, recall_settings

    made = []
    monkeypatch.setattr(starts, "CrafterStarts", lambda **k: made.append((k["recall"], k["placing"])))
    for recall in ("null", "{}"):  # posttrain.data, the job's data, hands starts.* on: null stays None, {} a dict
        cfg = compose("posttrain", ["data=crafter_tiles", f"starts.recall={recall}", "starts.placing={p: 0.5}"])
        instantiate(cfg.posttrain.data.source)
    assert made == [(None, {"p": 0.5}), ({}, {"p": 0.5})] and all(type(r) is dict for _, r in made)
    monkeypatch.undo()
    seen = []
    real_make = starts.make_policy
    monkeypatch.setattr(starts, "make_policy", lambda name, rng, recall, placing: seen.append((recall, placing))
                        or real_make(name, rng, recall, placing))
    layout = Layout(9, 9, 1)
    common = dict(layout=layout, codebook_size=145, frames=4, vq_path=str(REPO / "mcar/assets/vq_crafter_tiles"),
                  view=[9, 9], daylight=None, policy_mix={"wanderer": 1.0}, warmup=0)
    recall, placing = {"mix": {"wait": 1.0}}, {"p": 1.0, "kinds": ["table"]}
    clips = starts.CrafterStarts(**common, recall=recall)(7)
    assert len(clips) == 1 and clips[0][0].shape == (4 * layout.frame_len,) and clips[0][1].shape == (4, 2)
    (plain, where), = starts.CrafterStarts(**common)(7)
    placed = starts.CrafterStarts(**common, placing=placing)(7)[0][0]
    assert seen == [(recall_settings(recall), None), (None, None), (None, placing_settings(placing))]
    actions = lambda clip: clip.view(4, layout.frame_len)[:, -1] - 145  # noqa: E731
    assert ACTIONS.index("place_table") in actions(placed).tolist()
    assert ACTIONS.index("place_table") not in actions(plain).tolist()
    steps = where[1:] - where[:-1]  # the player's positions follow its moves (a refused one stays)
    moves = [MOVE_DELTA.get(a, (0, 0)) for a in actions(plain)[:-1].tolist()]
    assert all(tuple(d) in ((0, 0), m) for d, m in zip(steps.tolist(), moves)) and steps.abs().sum() > 0
    with pytest.raises(ValueError, match="recall: unknown"):
        starts.CrafterStarts(**common, recall={"bogus": 1})
    with pytest.raises(ValueError, match="placing: unknown"):
        starts.CrafterStarts(**common, placing={"bogus": 1})


def test_stale_rollouts_are_warned_about_once(caplog):
    """Rollouts whose log-probabilities are not the trainer's (drawn from other weights: the stale packed copies
    fa23dd9 fixed) are named in one warning; fresh ones are not."""
    import logging

    from mcar.train.posttrain import PostTrainModule

    post, kw = TINY_POST, TINY_MODULE
    module = PostTrainModule(post, **kw)
    module._logs_this_step = False
    clips = clips_of([[1, 2, 3, 4], [5, 6, 7, 8]])
    with caplog.at_level(logging.WARNING, logger="mcar"):
        module.training_step({"tokens": clips}, 0)
        assert "rollouts were not drawn" not in caplog.text
        fresh = module.rollouts
        module.rollouts = lambda real, step, positions: {**(r := fresh(real, step)), "old_logp": r["old_logp"] + 1e-2}
        module.training_step({"tokens": clips}, 0)
        module.training_step({"tokens": clips}, 0)
    assert caplog.text.count("rollouts were not drawn from the weights being trained") == 1
