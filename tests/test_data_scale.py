"""Issue 5/5 item 1: clip indexing in O(episodes) memory gives the same clips in the same order as the table of
every (episode, first frame) it replaced, and maps no more shards at once than it may."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcar.core.layout import Layout
from mcar.data.token_clips import TokenClips
from mcar.data.tokenize import build_index
from mcar.tokenizer.clips import join_clip

LAYOUT, CODES, ACTIONS = Layout(2, 3, 1), 16, 4


def write_episodes(folder, lengths: list[int]) -> tuple[list[str], dict]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(len(lengths))
    names = [f"ep{i:03d}" for i in range(len(lengths))]
    for name, T in zip(names, lengths):
        np.save(folder / f"{name}.frames.npy", rng.integers(0, CODES, (T, 2, 3)).astype(np.uint16))
        np.save(folder / f"{name}.actions.npy", rng.integers(0, ACTIONS, (T, 1)).astype(np.uint16))
    index = build_index(folder, {"codebook_size": CODES, "n_a": 1, "action_vocab_size": ACTIONS})
    return names, {e["name"]: e for e in index["episodes"]}


def table_of_starts(folder, names, frames, stride):
    """The old indexing, an oracle sharing no code with TokenClips: every (episode, first frame) in a list."""
    starts = []
    for e, name in enumerate(names):
        T = len(np.load(folder / f"{name}.frames.npy"))
        starts += [(e, t) for t in range(0, T - frames + 1, stride)]
    return starts


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 13), min_size=1, max_size=6), frames=st.integers(1, 5),
       stride=st.integers(1, 4))
def test_the_same_clips_in_the_same_order_as_the_table_of_starts(tmp_path_factory, lengths, frames, stride):
    folder = tmp_path_factory.mktemp("tokens")
    names, entries = write_episodes(folder, lengths)
    clips = TokenClips(folder, names, LAYOUT, frames, CODES, stride, ACTIONS, entries)
    oracle = table_of_starts(folder, names, frames, stride)
    assert len(clips) == len(oracle)
    for i, (e, t) in enumerate(oracle):
        assert clips.locate(i) == (e, t)
        toks = np.load(folder / f"{names[e]}.frames.npy")[t:t + frames]
        acts = np.load(folder / f"{names[e]}.actions.npy")[t:t + frames]
        assert np.array_equal(clips.clip(i).numpy(), join_clip(toks, acts, CODES).numpy())
    with pytest.raises(IndexError):
        clips.locate(len(oracle))


def test_memory_is_per_episode_and_few_shards_stay_mapped(tmp_path, monkeypatch):
    names, entries = write_episodes(tmp_path, [9] * 40)
    monkeypatch.setattr(TokenClips, "OPEN_SHARDS", 4)
    clips = TokenClips(tmp_path, names, LAYOUT, 3, CODES, 2, ACTIONS, entries)
    assert len(clips) == 40 * 4 and clips.ends.shape == (40,)  # one number per episode, not one per clip
    assert not clips._open  # nothing mapped at start
    for i in range(len(clips)):
        clips.clip(i)
        assert len(clips._open) <= 4
    assert list(clips._open) == [36, 37, 38, 39]  # the newest
