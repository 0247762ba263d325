"""The speed statistics (mcar.core.latency) against numpy as the oracle."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcar.core.latency import deadline_attainment, latency_summary, percentile

seconds = st.lists(st.floats(min_value=0.0, max_value=100.0, allow_nan=False), min_size=1, max_size=50)


@settings(max_examples=60, deadline=None)
@given(seconds, st.floats(min_value=0.0, max_value=100.0))
def test_percentile_is_numpys_linear(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(seconds, st.floats(min_value=0.01, max_value=1000.0))
def test_attainment_is_the_share_within_one_over_rate(values, rate):
    expected = float(np.mean(np.asarray(values) <= 1.0 / rate))
    assert deadline_attainment(values, rate) == pytest.approx(expected)


def test_summary_keys_and_empty():
    s = latency_summary([0.1, 0.2, 0.3, 0.4], rate=4)
    assert s["frames"] == 4 and s["p50_s"] == pytest.approx(0.25) and s["deadline_attainment"] == 0.5
    assert math.isnan(latency_summary([])["p95_s"])
    with pytest.raises(ValueError, match="rate"):
        deadline_attainment([0.1], 0)


def test_the_test_runs_progress_line():
    from tests.progress_line import progress_line

    assert progress_line(120, 855, 84.0, failed=1) == "-- 120/855 tests (14%), 1 failed, in 1.4 min, ~8.6 min left"
    assert progress_line(855, 855, 600.0) == "-- 855/855 tests (100%), in 10.0 min"
