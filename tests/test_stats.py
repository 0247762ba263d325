"""The statistics every report shares (mcar/eval/stats.py): the percentile bootstrap over clips, intervals over
starts, pooled over starts, and of paired differences."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mcar.eval import stats as S
from mcar.eval.stats import interval, paired_interval, pooled_interval


def test_bootstrap_interval_of_known_data():
    """Percentile bootstrap over clips: seeded (same seed, same interval), a point where every clip agrees, about
    mean +- 1.96 standard errors for 100 coin flips, wider at a higher level; the PSNR pool keeps inf."""
    from mcar.eval.metric_registry import mean_of, psnr_of_mean_mse

    assert S.bootstrap_ci(torch.full((7,), 0.25), mean_of) == (0.25, 0.25)
    flips = torch.tensor([0.0, 1.0] * 50)  # mean 0.5, standard error 0.05
    lo, hi = S.bootstrap_ci(flips, mean_of, seed=1)
    assert (lo, hi) == S.bootstrap_ci(flips, mean_of, seed=1) and (lo, hi) != S.bootstrap_ci(flips, mean_of, seed=2)
    assert lo == pytest.approx(0.5 - 1.96 * 0.05, abs=0.02) and hi == pytest.approx(0.5 + 1.96 * 0.05, abs=0.02)
    lo99, hi99 = S.bootstrap_ci(flips, mean_of, seed=1, level=0.99)
    assert lo99 <= lo < 0.5 < hi <= hi99
    assert S.bootstrap_ci(torch.zeros(4), psnr_of_mean_mse) == (math.inf, math.inf)  # every clip exact
    lo, hi = S.bootstrap_ci(torch.tensor([0.0, 0.01]), psnr_of_mean_mse)  # a quarter of resamples: exact only
    assert lo == pytest.approx(20) and hi == math.inf  # inf, never nan


def test_pooled_interval_draws_starts_not_moves():
    v = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    one = pooled_interval(v, [7] * 6, 0)
    assert one == {"mean": pytest.approx(4 / 6), "lo": None, "hi": None, "n": 6, "starts": 1}
    two = pooled_interval(v, [0, 0, 0, 1, 1, 1], 0)  # start 0 kept all three, start 1 one of three
    assert two["mean"] == pytest.approx(4 / 6) and two["starts"] == 2
    assert two["lo"] == pytest.approx(1 / 3) and two["hi"] == 1.0  # a draw is both starts' moves, or one's twice


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=2, max_size=12), st.integers(0, 3))
def test_a_paired_interval_is_the_interval_of_the_differences(pairs, seed):
    """Start by start: the paired interval's mean is the difference of the means, its bounds the percentile bootstrap
    of the per-start differences (one draw of starts for both rows, so a shift common to both cancels)."""
    a, b = (torch.tensor(x, dtype=torch.float64) for x in zip(*pairs))
    d = paired_interval(a.tolist(), b.tolist(), seed)
    assert d["mean"] == pytest.approx(float(a.mean() - b.mean()), abs=1e-12) and d["n"] == len(a)
    draws = torch.randint(len(a), (1000, len(a)), generator=torch.Generator().manual_seed(seed))
    means = (a - b)[draws].mean(-1).sort().values  # an oracle of its own: the resampled means' order statistics
    assert (d["lo"], d["hi"]) == pytest.approx((float(means[math.floor(0.025 * 999)]),
                                                float(means[math.ceil(0.975 * 999)])))
    shifted = paired_interval((a + 0.5).tolist(), (b + 0.5).tolist(), seed)
    assert (shifted["lo"], shifted["hi"]) == pytest.approx((d["lo"], d["hi"]))
    assert interval(a - b, seed)["per_start"] == d["per_start"]
