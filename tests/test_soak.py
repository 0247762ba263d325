"""The short form of `mcar soak`: kill -9 a training run at random moments, resume it each
time; every step's loss and the final weights equal an uninterrupted run's (the long form is in BENCHMARKS.md)."""
import json

import pytest

from tests.conftest import SMALL_DATA, run_script


@pytest.mark.slow
def test_soak_kills_and_resumes_bit_identically(tmp_path):
    p = run_script("-m mcar.cli soak", f"out={tmp_path}", "kills=3", "every=10", *SMALL_DATA, "trainer.max_steps=120",
                   timeout=900)
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "soak.json").read_text())
    assert result["kills"] == 3 and result["starts"] == 4
    assert sorted(result["kill_after_checkpoint_steps"]) == result["kill_after_checkpoint_steps"]
    # seed 0's first kill is due at the checkpoint after step 15 plus < 0.8 of an interval: a wait timed from the
    # process start (its start-up included) let it slip to step 60, and on a busy machine later kills past the end
    assert result["kill_after_checkpoint_steps"][0] <= 30
    assert result["steps"] == result["steps_compared"] == 120 and result["mismatches"] == 0
    assert result["final_weights_equal"]


def test_step_losses_keep_the_last_logged_value(tmp_path):
    """A resume repeats the steps after its checkpoint: the later log's value is the one compared."""
    import os
    import time

    from mcar.tools.soak import step_losses

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "metrics.csv").write_text("step,train/loss\n0,1.5\n1,1.25\n2,9.0\n")
    (tmp_path / "b" / "metrics.csv").write_text("step,train/loss,val/loss\n2,1.0,\n3,0.5,\n3,,0.7\n")
    old = time.time() - 100
    os.utime(tmp_path / "a" / "metrics.csv", (old, old))
    assert step_losses(tmp_path) == {0: "1.5", 1: "1.25", 2: "1.0", 3: "0.5"}
