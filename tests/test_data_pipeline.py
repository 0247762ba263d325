"""The input pipeline: O(1) seeded clip order (every epoch a permutation, ranks slice the global batch),
loader workers that keep the step order and exact resume, and synthetic clips unchanged by their speed-up."""
import hashlib
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mcar.core.layout import Layout
from mcar.data.common import EpochPermutation, StepBatches, clip_indices
from mcar.data.synthetic import SHIFTS, SyntheticClips, SyntheticDataModule

from .conftest import REPO, compose

SIZES = [1, 2, 3, 4, 5, 7, 15, 16, 17, 63, 64, 65, 97, 256, 1000, 1021, 1024, 4096, 4099]


def order(n: int, seed: int, epoch: int) -> list[int]:
    perm = EpochPermutation(n, seed, epoch)
    return [perm[k] for k in range(n)]


@pytest.mark.parametrize("n", SIZES)
def test_each_epoch_is_a_permutation(n):
    for seed, epoch in [(0, 0), (1, 0), (0, 1), (-3, 7), (2**70, 2**40)]:
        assert sorted(order(n, seed, epoch)) == list(range(n))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3000), st.integers(-2**63, 2**64), st.integers(0, 10**6))
def test_each_epoch_is_a_permutation_any_size(n, seed, epoch):
    assert sorted(order(n, seed, epoch)) == list(range(n))


def test_out_of_range_positions_are_an_error():
    with pytest.raises(IndexError):
        EpochPermutation(10, 0, 0)[10]
    with pytest.raises(ValueError):
        EpochPermutation(0, 0, 0)


def test_seeds_and_epochs_give_different_orders():
    orders = {tuple(order(1000, seed, epoch)) for seed in range(5) for epoch in range(3)}
    assert len(orders) == 15
    assert len({tuple(order(5, seed, 0)) for seed in range(30)}) > 10  # even tiny domains are shuffled


@pytest.mark.parametrize("seed", range(5))
def test_order_is_not_trivially_correlated(seed):
    """Not the identity, a reversal or a near-rotation: position vs clip and consecutive clips are uncorrelated
    (Spearman; the values are ranks already), and no single step between consecutive clips dominates."""
    n = 1000
    v = torch.tensor(order(n, seed, 0), dtype=torch.float64)
    rho = lambda a, b: torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(rho(torch.arange(n, dtype=torch.float64), v)) < 0.1
    assert abs(rho(v[:-1], v[1:])) < 0.1
    steps = torch.remainder(v[1:] - v[:-1], n).long()
    assert torch.bincount(steps).max() < 10  # a rotation would repeat one step ~n times


@pytest.mark.parametrize("n,batch,world", [(1, 1, 1), (7, 3, 1), (10, 4, 2), (64, 8, 1), (97, 5, 3)])
def test_every_epoch_visits_every_clip_once(n, batch, world):
    steps = 3 * n // (batch * world) + 2
    walk = [i for s in range(steps) for r in range(world) for i in clip_indices(n, batch, 11, s, r, world)]
    for e in range(len(walk) // n):
        assert sorted(walk[e * n:(e + 1) * n]) == list(range(n)), f"epoch {e}"
    assert walk[:n] != walk[n:2 * n] or n < 3  # a new order each epoch


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 500), st.integers(1, 8), st.integers(1, 4), st.integers(0, 10**7), st.integers(0, 100))
def test_ranks_split_the_world_size_one_batch(n, batch, world, step, seed):
    """Rank r's clips are slice r of the batch of B * world clips a world-size-1 run draws at the same step."""
    ranks = [clip_indices(n, batch, seed, step, r, world) for r in range(world)]
    assert sum(ranks, []) == clip_indices(n, batch * world, seed, step)
    first = step * batch * world
    if first // n == (first + batch * world - 1) // n:  # one epoch: no clip twice in the step
        assert len(set(sum(ranks, []))) == batch * world


def test_batches_are_a_pure_function_of_seed_step_and_rank():
    src = SyntheticClips(Layout(3, 4, 2), 3, 32, 8, 5_000_000, 0)  # millions of clips cost nothing
    a, b = StepBatches(src, 4, seed=3, rank=1, world=2), StepBatches(src, 4, seed=3, rank=1, world=2)
    assert torch.equal(a[123_456]["tokens"], b[123_456]["tokens"])
    assert a[123_456]["clip_index"].tolist() == clip_indices(5_000_000, 4, 3, 123_456, 1, 2)
    assert a.indices(7) != StepBatches(src, 4, seed=4, rank=1, world=2).indices(7)


# ---- loader workers --------------------------------------------------------------------------------------
def fake_trainer(global_step=0, device="cpu", devices=1):
    """What ClipDataModule reads from a Lightning trainer."""
    return SimpleNamespace(global_step=global_step, accumulate_grad_batches=1, global_rank=0, world_size=1,
                           num_devices=devices, strategy=SimpleNamespace(root_device=torch.device(device)))


def datamodule(num_workers=None, trainer=None) -> SyntheticDataModule:
    dm = SyntheticDataModule(h=3, w=4, n_a=2, codebook_size=32, action_vocab_size=8, clip_frames=3, batch_size=3,
                             train_clips=50, val_clips=2, seed=5, num_workers=num_workers)
    dm.trainer = trainer
    dm.setup("fit")
    return dm


def test_workers_keep_the_step_order_and_resume_exactly():
    reference = StepBatches(datamodule().train_source, 3, seed=5)
    from_start = iter(datamodule(2, fake_trainer(0)).train_dataloader())
    resumed = iter(datamodule(2, fake_trainer(5)).train_dataloader())  # restored at global step 5
    first = [next(from_start) for _ in range(10)]
    for s in range(10):
        assert first[s]["clip_index"].tolist() == reference.indices(s), f"step {s} out of order"
    for s in range(5, 10):
        again = next(resumed)
        assert torch.equal(again["clip_index"], first[s]["clip_index"])
        assert torch.equal(again["tokens"], first[s]["tokens"])


def test_auto_workers_and_pinned_memory(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    cpu = datamodule(None, fake_trainer())
    assert cpu.loader_workers() == 0 and not cpu.train_dataloader().pin_memory  # CPU: the step needs the cores
    for devices, workers in [(1, 4), (4, 3), (8, 1), (32, 1)]:
        assert datamodule(None, fake_trainer(device="cuda", devices=devices)).loader_workers() == workers
    gpu = datamodule(None, fake_trainer(device="cuda")).train_dataloader()
    assert gpu.pin_memory and gpu.num_workers == 4 and gpu.persistent_workers
    assert datamodule(0, fake_trainer(device="cuda")).train_dataloader().num_workers == 0  # an integer wins
    assert datamodule(3, fake_trainer()).loader_workers() == 3
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "3")  # a SLURM task's cores are its own
    assert datamodule(None, fake_trainer(device="cuda", devices=8)).loader_workers() == 2


# ---- synthetic clips -------------------------------------------------------------------------------------
def reference_clip(src: SyntheticClips, i: int) -> torch.Tensor:
    """SyntheticClips.clip before it was vectorised (one generator draw and one roll per frame)."""
    lay, g = src.layout, torch.Generator().manual_seed(src.seed * 1_000_003 + i)
    frame = torch.randint(0, src.codebook_size, (lay.h, lay.w), generator=g)
    out = []
    for _ in range(src.frames):
        action = int(torch.randint(0, len(SHIFTS), (1,), generator=g)) if lay.n_a else 0
        out += [frame.flatten(), torch.full((lay.n_a,), src.codebook_size + action)]
        frame = frame.roll(SHIFTS[action], dims=(0, 1))
    return torch.cat(out)


# sha256 of clips 0, 1, 2, 17, 999_999, 123_456, computed with the code before the speed-up
GOLDEN = [((14, 24, 11), 16, 1024, 64, 3, "74ed970903907eaf"), ((3, 4, 2), 3, 32, 8, 0, "3c74cc8a4f72151c"),
          ((5, 7, 0), 5, 50, 0, 1, "34471501b418ca15"), ((2, 2, 1), 2, 7, 5, 12, "d5dcdc37236a7296")]


@pytest.mark.parametrize("geometry,frames,codebook,actions,seed,digest", GOLDEN)
def test_synthetic_clips_are_unchanged(geometry, frames, codebook, actions, seed, digest):
    src = SyntheticClips(Layout(*geometry), frames, codebook, actions, 10**6, seed)
    h = hashlib.sha256()
    for i in [0, 1, 2, 17, 999_999, 123_456]:
        clip = src.clip(i)
        assert clip.dtype == torch.long and clip.shape == (frames * Layout(*geometry).frame_len,)
        h.update(clip.numpy().tobytes())
    assert h.hexdigest()[:16] == digest


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(0, 4), st.integers(1, 80), st.integers(0, 10**9),
       st.integers(0, 50))
def test_synthetic_clips_match_the_per_frame_reference(h, w, n_a, frames, i, seed):
    src = SyntheticClips(Layout(h, w, n_a), frames, 100, 8, 10**9 + 1, seed)
    assert torch.equal(src.clip(i), reference_clip(src, i))


FOLDER_KEYS = {"vpt": "data.root", "mineworld": "data.root", "tokens": "data.tokens_dir", "stream": "data.stream_dir"}


@pytest.mark.parametrize("data", sorted(p.stem for p in (REPO / "mcar" / "conf" / "data").glob("*.yaml")))
def test_data_configs_are_strict_an_unknown_key_is_an_error_naming_it(data, tmp_path):
    from mcar.data.common import build_datamodule, complete_data_config

    if data == "stream":
        pytest.importorskip("litdata")
    base = [f"data={data}", f"paths.data_dir={tmp_path}"] + ([f"{FOLDER_KEYS[data]}=/nowhere"] if data in FOLDER_KEYS
                                                               else [])
    if data == "recordings":  # its config is completed from a real folder first, as every job does
        from .test_recordings import write_recordings

        base.append(f"data.root={write_recordings(tmp_path / 'rec', episodes=2, frames=8)}")

    def built(overrides):
        cfg = compose("train", overrides)
        complete_data_config(cfg)
        return build_datamodule(cfg.data)

    built(base)  # every shipped data config is accepted as it is
    with pytest.raises(ValueError, match=r"data.batchsize is not a setting of mcar\.[\w.]+ .*conf/data/"):
        built([*base, "+data.batchsize=4"])
    with pytest.raises(ValueError, match=r"data.vocab_size=7 must equal data.codebook_size \+ data.action_vocab_size"):
        built([*base, "data.vocab_size=7"])
