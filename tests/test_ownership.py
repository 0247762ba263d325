"""A run owns its directories: a second live run is refused naming the owner, a killed
run's lock is taken over, an unwritable location fails before any work, a fresh run never writes beside another
run's checkpoints."""
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys

import pytest

from mcar.data.files import FolderLock
from mcar.train.ownership import LOCK, check_fresh_checkpoint_dir, claim, release
from tests.conftest import REPO, SMALL_DATA, job_overrides, run_in_process, run_script, script_env


def test_a_live_owner_is_refused_and_a_killed_ones_lock_is_free(tmp_path):
    code = (f"from mcar.train.ownership import claim; import time; claim({str(tmp_path)!r}, 'output dir', 'seed1');"
            f" print('held', flush=True); time.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match=rf"output dir {tmp_path} belongs to another run that is still going "
                                               rf"\(run_name='seed1', pid {other.pid}"):
            claim(tmp_path, "output dir", "seed2")
    finally:
        other.kill()  # kill -9: the kernel drops its lock; its lock file stays behind
        other.wait()
    assert (tmp_path / LOCK).exists()
    lock = claim(tmp_path, "output dir", "seed2")
    assert json.loads(lock.read_text())["pid"] == os.getpid() and claim(tmp_path, "output dir", "x") == lock
    release(lock)
    assert not lock.exists()


_FORKING_OWNER = r"""
import multiprocessing, os, sys, time
from mcar.data.files import FolderLock
assert FolderLock(sys.argv[1], ".mcar-run.lock").acquire(blocking=False, run_name="parent")


def work():  # runs after the fork hooks: the child has dropped its copy of the lock by now
    os.write(1, b"running\n")  # one write: the parent writes to the same pipe
    time.sleep(120)


if sys.argv[2] == "os.fork":
    child = os.fork()
    if child == 0:
        work()
        os._exit(0)
else:  # a DataLoader worker's way
    proc = multiprocessing.get_context("fork").Process(target=work, daemon=True)
    proc.start()
    child = proc.pid
os.write(1, f"child {child}\n".encode())
time.sleep(120)
"""


@pytest.mark.parametrize("fork", ["os.fork", "multiprocessing"])
def test_a_killed_runs_lock_is_free_at_once_while_its_forked_children_live(tmp_path, fork):
    """A flock belongs to the open file, which forked children share: the lock outlived a kill -9 of its run for as
    long as the run's loader workers lived, and the resume was refused."""
    owner = subprocess.Popen([sys.executable, "-c", _FORKING_OWNER, str(tmp_path), fork], stdout=subprocess.PIPE,
                             text=True, cwd=REPO, env=script_env())
    lines = sorted(owner.stdout.readline().split() for _ in range(2))  # the child's line and its pid, either order
    assert lines[0][0] == "child" and lines[1] == ["running"], lines
    child = int(lines[0][1])
    try:
        owner.kill()
        owner.wait()
        os.kill(child, 0)  # the child still lives
        resumed = FolderLock(tmp_path, LOCK)
        assert resumed.acquire(blocking=False, run_name="resume")
        resumed.release()
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_forked_child_holds_none_of_its_parents_locks(tmp_path):
    """Nor does it release them: its exit (or a `release` in it) leaves the parent's lock and lock file alone."""
    lock = FolderLock(tmp_path, LOCK)
    assert lock.acquire(blocking=False)
    pid = os.fork()
    if pid == 0:
        code = 0 if not lock.held else 1
        lock.release()
        os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    assert lock.held and (tmp_path / LOCK).exists()
    assert not FolderLock(tmp_path, LOCK).acquire(blocking=False)
    lock.release()


def _claim_and_report(folder, barrier, results):
    try:
        results.put(claim(folder, "output dir", f"p{os.getpid()}") is not None)
    except RuntimeError:
        results.put(False)
    barrier.wait()  # nobody releases before everyone has tried


def test_racing_claims_over_a_killed_runs_lock_leave_exactly_one_owner(tmp_path):
    """The old takeover (read, unlink, create) let two processes own one folder in about 1 of 100 trials."""
    ctx = multiprocessing.get_context("fork")
    for trial in range(25):
        folder = tmp_path / f"t{trial}"
        folder.mkdir()
        (folder / LOCK).write_text(json.dumps({"pid": 999999, "host": os.uname().nodename}))  # a killed run's
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_claim_and_report, args=(folder, barrier, results)) for _ in range(4)]
        for proc in procs:
            proc.start()
        owners = sum(results.get(timeout=60) for _ in procs)
        for proc in procs:
            proc.join(60)
        assert owners == 1, f"trial {trial}: {owners} owners"


def test_only_global_rank_zero_locks(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert claim(tmp_path / "d", "output dir", "r") is None and not (tmp_path / "d" / LOCK).exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_folder_fails_at_once(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match=f"checkpoint dir {ro}/run is not writable|cannot be created"):
            claim(ro / "run", "checkpoint dir", "r")
    finally:
        ro.chmod(0o700)


def test_unwritable_checkpoint_root_stops_train_before_the_first_step(tmp_path):
    """Root ignores permissions here, so a regular file stands where the checkpoint root should be."""
    (tmp_path / "ckpt").write_text("a file, not a folder")
    p = run_script("train.py", *SMALL_DATA, f"paths.checkpoint_root={tmp_path}/ckpt", f"hydra.run.dir={tmp_path}/out",
                   "logger=none", "trainer.max_steps=2", check=False)
    assert p.returncode != 0
    assert f"checkpoint dir {tmp_path}/ckpt/train-tiny-synthetic-causal cannot be created" in p.stderr
    assert "Epoch" not in p.stderr  # no training step ran


def test_fresh_run_refuses_another_runs_checkpoints(tmp_path):
    (tmp_path / "last.ckpt").write_bytes(b"")
    with pytest.raises(FileExistsError, match="already holds checkpoints of run 'seed1' \\(last.ckpt\\): resume it "
                                              "with ckpt_path=last, or start a new run with another run_name"):
        check_fresh_checkpoint_dir(tmp_path, "seed1")
    check_fresh_checkpoint_dir(tmp_path / "new", "seed2")  # absent or empty: fine


def test_running_the_same_command_twice_gives_the_second_run_its_own_name(tmp_path, capsys):
    """Two fresh runs, one run_name: the second becomes <run_name>-2, beside the first (it used to share the dirs
    and write -v1 checkpoints, then it was refused: a dead end for a user who only ran the command again)."""
    from mcar.tools.train import main as train

    common = [*SMALL_DATA, *job_overrides(tmp_path), "logger=none", "trainer.max_steps=2",
              "checkpoint.every_n_steps=1", "run_name=same"]
    run_in_process(train, *common, "seed=1")
    first = (tmp_path / "ckpt" / "same" / "last.ckpt").read_bytes()
    capsys.readouterr()
    run_in_process(train, *common, "seed=2", f"hydra.run.dir={tmp_path}/out2")
    out = capsys.readouterr()
    assert "this fresh run is same-2 (resume the first with ckpt_path=last run_name=same)" in out.out + out.err
    for name in ("same", "same-2"):
        assert sorted(f.name for f in (tmp_path / "ckpt" / name).glob("*.ckpt")) == \
            ["last.ckpt", "step0000001.ckpt", "step0000002.ckpt"]
        assert not (tmp_path / "ckpt" / name / LOCK).exists()  # released at the end of each run
    assert (tmp_path / "ckpt" / "same" / "last.ckpt").read_bytes() == first
    run_in_process(train, *common, f"hydra.run.dir={tmp_path}/out3", "ckpt_path=last", "trainer.max_steps=3")
    assert sorted(f.name for f in (tmp_path / "ckpt" / "same").glob("step*.ckpt"))[-1] == "step0000003.ckpt"


def test_our_errors_end_with_their_message_not_a_traceback(tmp_path):
    """The command as a user runs it; with HYDRA_FULL_ERROR=1 the error itself is raised (its traceback)."""
    from mcar.tools.train import main as train

    env = {k: v for k, v in script_env().items() if k != "HYDRA_FULL_ERROR"}
    overrides = [*SMALL_DATA, *job_overrides(tmp_path), "logger=none", "trainer.max_steps=0"]
    p = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 1 and "Error: " in p.stderr and "nothing to train" in p.stderr
    assert "Traceback" not in p.stderr and "(the traceback: HYDRA_FULL_ERROR=1)" in p.stderr
    with pytest.raises(ValueError, match="nothing to train"):
        run_in_process(train, *overrides)  # HYDRA_FULL_ERROR=1


# ---------------------------------------------------------------------------------------------- silent surprises
def test_surprises_are_messages(tmp_path, tiny_checkpoint, capsys):
    """Each of these used to pass silently or with torch's own text (the commands' main, in this
    process: the output of a failed command is test_our_errors_end_with_their_message_not_a_traceback's)."""
    from mcar.tools.finetune import main as finetune
    from mcar.tools.train import main as train

    common = [*SMALL_DATA, "logger=none", "trainer.max_steps=2", "checkpoint.every_n_steps=2"]
    with pytest.raises(SystemExit, match=re.escape("mcar train: optim.lr=-1: optim.lr takes a finite number > 0")):
        run_in_process(train, *common, *job_overrides(tmp_path, "a"), "optim.lr=-1")  # before any work
    with pytest.raises(ValueError, match=re.escape("trainer.max_steps=0: nothing to train")):
        run_in_process(train, *common, *job_overrides(tmp_path, "b"), "trainer.max_steps=0")
    capsys.readouterr()
    run_in_process(train, *common, f"paths.checkpoint_root={tiny_checkpoint.parents[1]}",
                   f"hydra.run.dir={tmp_path}/d", "ckpt_path=last")  # the run of tiny_checkpoint, 2 steps done
    out = capsys.readouterr()
    assert "this run already finished (step 2, trainer.max_steps=2): nothing to train" in out.out + out.err
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    with pytest.raises(ValueError, match=re.escape(f"{text} is not a checkpoint written by torch.save: it starts "
                                                   f"with b'not '")):
        run_in_process(finetune, *common, *job_overrides(tmp_path, "e"), f"init_from={text}")
    with pytest.raises(ValueError, match="model=small: fine-tuning keeps the model of init_from"):
        run_in_process(finetune, *common, *job_overrides(tmp_path, "f"), f"init_from={tiny_checkpoint}",
                       "model=small")
