"""The one home of the learning-rate multipliers (mcar.core.lr_schedule): warm-up then cosine (training, the IDM),
warm-up then a late linear decay (the VQ)."""
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcar.core.lr_schedule import constant, warmup_cosine, warmup_linear_decay


def test_warmup_cosine_values():
    # warm-up 4, cosine over steps 4..10 down to 0.1
    assert [warmup_cosine(s, 4, 10, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert warmup_cosine(4, 4, 10, 0.1) == 1.0
    assert warmup_cosine(7, 4, 10, 0.1) == pytest.approx(0.55, abs=1e-15)  # half way: 0.1 + 0.9 / 2
    assert warmup_cosine(10, 4, 10, 0.1) == warmup_cosine(99, 4, 10, 0.1) == pytest.approx(0.1, abs=1e-15)
    assert warmup_cosine(50, 100, 10, 0.1) == 0.51 and warmup_cosine(200, 100, 10, 0.1) == 1.0  # total <= warm-up


@given(st.integers(0, 5000), st.integers(1, 100), st.integers(1, 5000), st.floats(0, 1))
def test_warmup_cosine_is_linear_then_cosine(step, warmup, total, min_ratio):
    f = warmup_cosine(step, warmup, total, min_ratio)
    if step < warmup:
        assert f == (step + 1) / warmup
    elif total <= warmup:
        assert f == 1.0
    else:
        progress = min(step - warmup, total - warmup) / (total - warmup)
        assert f == pytest.approx(min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * progress)) / 2, abs=1e-12)


def test_constant_and_the_vq_decay_share_the_warm_up():
    assert [constant(s, 10, 2) for s in range(4)] == [0.5, 1.0, 1.0, 1.0] and constant(0, 10) == 1.0
    # warm-up 2, flat to step 8 (the last 20% of 10 steps decays), linearly to 0.1 at step 10, flat after
    got = [warmup_linear_decay(s, 2, 10, 0.2, 0.1) for s in range(12)]
    assert got == pytest.approx([0.5, 1, 1, 1, 1, 1, 1, 1, 1, 0.55, 0.1, 0.1], abs=1e-12)

