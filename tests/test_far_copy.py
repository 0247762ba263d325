"""The training loss's far-copy weight (memory past two frames): `far_copy_slots` finds the image
tokens a view shows again after a wait or a longer walk, which no copy from the two frames before gives; checked
against walks in a world of distinct tokens, where a token is at the same place in two frames exactly when the
views are. `weighted_loss` is masked_loss with weights; the module weights the rows predicting them, any mask."""
import pytest
import torch

from mcar.core.layout import Layout
from mcar.core.masks import CausalMask, far_copy_slots, masked_loss, weighted_loss

LAYOUT = Layout(3, 4, 1)
MOVES = {"R": (1, 0), "L": (-1, 0), "U": (0, -1), "D": (0, 1), "0": (0, 0)}


def walk_clip(walk: str) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A player's views (3x4 crops of a 30x30 world of distinct tokens) along `walk`, one frame per step and one
    before, as a (1, N) clip with action slots -> (clip, the view's offset per frame)."""
    world = torch.randperm(900).view(30, 30) % 1000
    offs = [(0, 0)]
    for m in walk:
        offs.append((offs[-1][0] + MOVES[m][0], offs[-1][1] + MOVES[m][1]))
    frames = [torch.cat([world[10 + dy:13 + dy, 10 + dx:14 + dx].flatten(), torch.tensor([1000])]) for dx, dy in offs]
    return torch.cat(frames)[None], offs


@pytest.mark.parametrize("walk", ["R00L", "RL", "RDUL", "RRLL", "R0L", "RR0LL", "0000"])
def test_far_copy_slots_are_the_frames_back_at_a_view_left_three_or_more_frames_before(walk):
    clip, offs = walk_clip(walk)
    frames = len(offs)
    got = far_copy_slots(clip, LAYOUT, frames).view(frames, LAYOUT.frame_len)
    for t, off in enumerate(offs):
        want = t >= 3 and off not in offs[t - 2:t] and off in offs[:t - 2]
        assert bool(got[t, :LAYOUT.frame_tokens].all()) == want and bool(got[t].any()) == want, (walk, t)
    assert not got[:, LAYOUT.frame_tokens:].any()  # action slots never


def test_weighted_loss_is_the_weighted_mean_over_the_slots_with_a_target():
    g = torch.Generator().manual_seed(0)
    clip, offs = walk_clip("R00L")
    batch = CausalMask(LAYOUT, len(offs))(clip)
    logits = torch.randn(*batch.targets.shape, 1001, generator=g)
    assert torch.allclose(weighted_loss(logits, batch.targets, torch.ones_like(clip)), masked_loss(logits,
                                                                                                  batch.targets))
    w = 1 + 4 * torch.rand(clip.shape, generator=g)
    ce = torch.nn.functional.cross_entropy(logits[0], batch.targets[0].clamp(min=0), reduction="none")
    keep = batch.targets[0] != -100
    assert torch.allclose(weighted_loss(logits, batch.targets, w), (ce * w[0])[keep].sum() / w[0][keep].sum())


@pytest.mark.parametrize("mask", ["causal", "diagd"])
def test_the_module_weights_each_input_row_by_the_slot_it_predicts(mask):
    """Under either mask the far-copy weight lands on the input row that predicts each far slot: the causal mask's
    slot before it, DiagD's predictor row (a proxy row where the schedule feeds one). The oracle weights the rows
    from the factory's slot -> predictor map, not from the target gather the module uses."""
    from mcar.train.module import MCARModule

    torch.manual_seed(0)
    clip, offs = walk_clip("R00L")
    frames = len(offs)
    clip = clip % 40  # the tiny model's vocabulary: tokens repeat, so far slots are a few, not whole frames
    clip.view(frames, -1)[:, -1] = 39
    kw = dict(arch=dict(vocab_size=40, dim=32, n_layers=1, n_heads=4, mlp_dim=64), layout=dict(h=3, w=4, n_a=1),
              clip_frames=frames, mask={"name": mask}, optim={}, max_steps=1)
    module = MCARModule(**kw, far_copy_weight=5.0)
    factory, far = module.mask_factory, far_copy_slots(clip, LAYOUT, frames)[0]
    assert far.any()
    batch = factory(clip)
    predictor = factory.predictor_row if mask == "diagd" else torch.arange(clip.shape[1]) - 1
    rows = predictor[far]
    assert (rows >= 0).all() and (batch.targets[0, rows] == clip[0, far]).all()
    w = torch.ones(batch.targets.shape[1])
    w[rows] = 5.0
    with torch.no_grad():
        logits = module.model(batch.tokens, batch.coords, batch.mask)[0]
        ce = torch.nn.functional.cross_entropy(logits, batch.targets[0].clamp(min=0), reduction="none")
        keep = batch.targets[0] != -100
        want = (ce * w)[keep].sum() / w[keep].sum()
        plain = module.forward_loss(clip)
        assert torch.allclose(module.forward_loss(clip, far_copy_weight=5.0), want)
        assert not torch.allclose(want, plain)
        assert torch.allclose(module.forward_loss(clip, far_copy_weight=1.0), plain)


def test_context_noise_corrupts_the_input_image_tokens_and_keeps_the_targets():
    """context_noise: a share of the input's image tokens (per clip, up to the setting) replaced by image codes;
    the actions and every target stay the real clip's; 0 is the plain loss."""
    from mcar.train.module import MCARModule

    torch.manual_seed(0)
    layout = dict(h=3, w=4, n_a=1)
    kw = dict(arch=dict(vocab_size=40, dim=32, n_layers=1, n_heads=4, mlp_dim=64), layout=layout, clip_frames=4,
              mask={"name": "causal"}, optim={}, max_steps=1, data={"codebook_size": 32})
    module = MCARModule(**kw, context_noise=0.5)
    clip = torch.randint(0, 32, (64, 4 * 13))
    clip.view(64, 4, 13)[:, :, -1] = 35  # action tokens
    noisy = module.noisy(clip, 0.5)
    changed = noisy != clip
    image = module.layout.is_image(4)
    assert not changed[:, ~image].any() and (noisy[:, image] < 32).all()  # image codes, in image slots only
    share = changed.float().mean(1) * 52 / 48
    assert 0.15 < share.mean() < 0.3 and share.max() < 0.6  # uniform shares up to 0.5 (a code may draw itself)
    torch.manual_seed(1)
    noisy_loss = module.forward_loss(clip, context_noise=0.5)
    torch.manual_seed(1)
    batch = module.mask_factory(clip)
    inputs = module.mask_factory(module.noisy(clip, 0.5)).tokens
    logits = module.model(inputs, batch.coords, batch.mask)
    assert torch.allclose(noisy_loss, masked_loss(logits, batch.targets))  # the real targets
    assert torch.allclose(module.forward_loss(clip), masked_loss(module.model(clip, batch.coords, batch.mask),
                                                                 batch.targets))
    with pytest.raises(ValueError, match="context_noise=0.1: needs the data's codebook_size"):
        MCARModule(**(kw | {"data": None}), context_noise=0.1)


@pytest.mark.parametrize("walk,back", [("R0L", [3]), ("R00L", [4]), ("R000L", [5]), ("R0000L", [6]),
                                       ("RR0LL", [3, 5])])
def test_the_memory_census_counts_each_far_copy_target_at_its_wait(walk, back):
    """scripts/memory_census.py's count: after a wait the returned views' far-copy targets come from the frames the
    walk left, `back` frames before each return (2 out, a noop, 2 back: 3 frames back, then 5)."""
    import importlib.util

    from .conftest import REPO

    spec = importlib.util.spec_from_file_location("memory_census", REPO / "scripts" / "memory_census.py")
    census = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(census)
    clip, offs = walk_clip(walk)
    targets, with_one = census.far_copy_by_distance(clip, LAYOUT, len(offs))
    far = int(far_copy_slots(clip, LAYOUT, len(offs)).sum())
    assert far > 0 and sum(targets[d] for d in back) == sum(targets.values()) == far
    assert all(targets[d] > 0 and with_one[d] == 1 for d in back)
