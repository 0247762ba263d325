"""The environment protocol (mcar/data/environment.py) and the world tests any environment takes
(mcar/eval/world_tests.py: rollout_test): a scrolling world that is not Crafter, scored against copy_last and its
own oracle; Crafter's implementation (mcar/crafter/env.py) saved and restored mid-episode."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mcar.core.layout import Layout
from mcar.data.environment import Environment, SavesState
from mcar.eval.world_tests import ModelRows, Tokens, images_of, rollout_test
from mcar.tokenizer.vq_model import decode_tokens, load_vq

from .conftest import REPO

TILE, H, W = 16, 3, 5  # a 3 x 5 token view of 16-pixel tiles


class ScrollWorld:
    """A ring of 2 W distinct tiles a row (each a code of the VQ, drawn as the VQ draws it), scrolled one tile left
    or right per move (0 noop, 1 left, 2 right), a view of W tiles; a world whose seed is a multiple of 3 ends at
    its second step (the tests skip it for the next seed)."""

    def __init__(self, vq):
        self.vq, self.seed, self.offset, self.steps, self.world = vq, 0, 0, 0, None

    def frame(self) -> np.ndarray:
        return np.roll(self.world, -self.offset * TILE, axis=1)[:, :W * TILE]

    def reset(self, seed: int) -> np.ndarray:
        codes = np.random.default_rng(seed).choice(int(self.vq.quantize.n_e), H * 2 * W, replace=False)
        pixels = decode_tokens(self.vq, torch.from_numpy(codes).view(1, H, 2 * W))[0]  # (3, H', W') in [-1, 1]
        self.world = ((pixels.permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
        self.seed, self.offset, self.steps = seed, 0, 0
        return self.frame()

    def step(self, action: int):
        self.offset += {0: 0, 1: -1, 2: 1}[int(action)]
        self.steps += 1
        return self.frame(), {"done": self.seed % 3 == 0 and self.steps == 2, "offset": self.offset}


def scrolled(clips: torch.Tensor, episodes, layout: Layout) -> torch.Tensor:
    """The oracle: the start frame's tokens rolled by each step's true offset (right where the view overlaps the
    start's, wrong on the tiles that came into view: a baseline an exact model beats)."""
    out = clips.clone()
    images = out.view(len(out), -1, layout.frame_len)[..., :layout.frame_tokens].unflatten(-1, (layout.h, layout.w))
    for b, ep in enumerate(episodes):
        for t, info in enumerate(ep.infos, start=1):
            images[b, t] = images[b, 0].roll(-info["offset"], dims=-1)
    return out


@pytest.fixture(scope="module")
def rows():
    vq = load_vq(REPO / "mcar" / "assets" / "vq_crafter_tiles")
    layout, cb = Layout(H, W, 1), int(vq.quantize.n_e)
    exact = SimpleNamespace(layout=layout, codebook_size=cb, vq=vq, context=4, sampler=lambda *a, **k: None,
                            generate=lambda clips, sampler, batch: (clips,))  # a model that gets every frame right
    return ModelRows(exact, prompt=1, batch_size=4), Tokens(vq, layout, cb)


def test_any_environment_takes_the_world_tests(rows):
    model, tokens = rows
    env = ScrollWorld(tokens.vq)
    assert isinstance(env, Environment) and not isinstance(env, SavesState)
    rng = np.random.default_rng(0)
    played = []
    oracle = lambda clips, eps: played.extend(ep.seed for ep in eps) or scrolled(clips, eps, model.layout)  # noqa: E731
    scores, curves = rollout_test(model, tokens, env, lambda frame: int(rng.integers(1, 3)), starts=3, frames=4,
                                  seed_base=0, seed=0, oracle=oracle)
    assert set(scores) == {"model context=4", "model context=2", "copy_last", "oracle"}
    assert all(len(c) == 3 for c in curves.values())  # one entry per generated step
    for row in ("model context=4", "model context=2"):
        assert scores[row]["mean"]["mean"] == 1.0 and scores[row]["invented_mean"]["mean"] == 0.0
    assert played == [1, 2, 4] and scores["copy_last"]["mean"]["n"] == 3  # worlds 0 and 3 ended early
    assert scores["copy_last"]["mean"]["mean"] < scores["oracle"]["mean"]["mean"] < 1.0


def test_rollout_scores_match_the_frames_counted_by_hand(rows):
    """copy_last's agreement is the share of tiles of each real frame that equal the start frame's, counted on
    the tokens of frames played by hand (no rollout_test code)."""
    model, tokens = rows
    env, actions = ScrollWorld(tokens.vq), [2, 2, 1]
    played = iter(actions)
    scores, _ = rollout_test(model, tokens, env, lambda frame: next(played), starts=1, frames=4, seed_base=1, seed=0)
    frames = [env.reset(1)] + [env.step(a)[0] for a in actions]
    images = tokens.images(frames)  # (4, h, w)
    by_hand = [(images[t] == images[0]).double().mean().item() for t in (1, 2, 3)]
    assert scores["copy_last"]["mean"]["mean"] == pytest.approx(sum(by_hand) / 3)
    assert scores["copy_last"]["last"]["mean"] == pytest.approx(by_hand[-1])
    assert images_of(torch.zeros(1, 2 * model.layout.frame_len, dtype=torch.long), model.layout).shape == (1, 2, H, W)


def test_crafter_saves_and_restores_its_whole_world():
    """CrafterEnv under the protocol: a restored world replays the saved one's future frame for frame (its random
    state copied too), and the same seed gives the same world; a step before reset is one clear error."""
    from mcar.crafter.env import CrafterEnv

    env = CrafterEnv((64, 64), (9, 9), daylight=1.0)
    assert isinstance(env, Environment) and isinstance(env, SavesState)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(0)
    actions = np.random.default_rng(0).integers(0, 17, 30)
    env.reset(3)
    for a in actions[:10]:
        env.step(a)
    state = env.save_state()
    future = [env.step(a) for a in actions[10:]]
    assert not np.array_equal(env.restore_state(state), future[-1][0])
    again = [env.step(a) for a in actions[10:]]
    assert all(np.array_equal(f, g) and i == j for (f, i), (g, j) in zip(future, again))
    assert env.restore_state(state) is not None and env.step(actions[10])[1] == future[0][1]  # usable twice
    fresh = CrafterEnv((64, 64), (9, 9), daylight=1.0)
    fresh.reset(3)
    assert np.array_equal([fresh.step(a) for a in actions][-1][0], future[-1][0])
    assert any(info["pos"] != future[0][1]["pos"] for _, info in future)  # the player moved: the test has teeth
