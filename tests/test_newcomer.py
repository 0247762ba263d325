"""A newcomer's first minutes: the README's commands for the shipped model (between its `newcomer` markers), run
verbatim from a fresh clone in a fresh venv, succeed and build no data (the model ships its held-out clips, its VQ
and its IDM). The venv borrows this environment's dependencies through a .pth line, so nothing is downloaded;
mcar itself is the clone's, installed with pip."""
import json
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

from tests.conftest import REPO


def newcomer_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- newcomer:begin -->\n(.*?)<!-- newcomer:end -->", text, flags=re.S)
    assert block, "README.md lost its <!-- newcomer:begin --> ... <!-- newcomer:end --> block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_names_the_shipped_model_commands():
    tools = [shlex.split(c)[:2] for c in newcomer_commands()]
    assert [t for _, t in tools] == ["generate", "evaluate", "bench"] and all(m == "mcar" for m, _ in tools)
    assert all("checkpoints/shipped/crafter_world" in c and "data=" not in c for c in newcomer_commands())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs git and a checkout")
def test_a_fresh_clone_runs_the_shipped_model_commands_without_building_data(tmp_path):
    clone = tmp_path / "mcar"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    if not (clone / "checkpoints" / "shipped" / "crafter_world" / "held_out").is_dir():
        pytest.skip("this checkout's HEAD predates the shipped held-out clips")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MCAR_ROOT", "HYDRA_FULL_ERROR")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    venv.create(tmp_path / "venv", with_pip=False)
    py = tmp_path / "venv" / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    deps = [p for p in site.getsitepackages() if "site-packages" in p]
    Path(purelib, "borrowed_deps.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-e", str(clone)], check=True, env=env, capture_output=True)
    env["PATH"] = f"{tmp_path / 'venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    seconds = {}
    for command in newcomer_commands():
        t0 = time.perf_counter()
        p = subprocess.run(shlex.split(command), cwd=clone, env=env, capture_output=True, text=True, timeout=600)
        seconds[command] = round(time.perf_counter() - t0, 1)
        assert p.returncode == 0, f"{command}\n{(p.stdout + p.stderr)[-3000:]}"
    print("newcomer commands (s):", json.dumps(seconds))
    assert sorted(p.name for p in (clone / "data").iterdir()) == ["README.md"], "a command built data"
    assert list((clone / "outputs" / "generate").glob("*/clip3_diagd.mp4"))
    results, = (clone / "outputs" / "evaluate").glob("*/results.json")
    row = json.loads(results.read_text())["rows"][0]
    assert isinstance(row["action_f1"], float), row  # the shipped IDM was found (idm=auto)
    bench, = (clone / "outputs" / "bench").glob("*/bench_play.json")
    assert all(r["frames_per_s"] > 0 for r in json.loads(bench.read_text())["steps"]["ks"].values())


def test_the_main_job_ends_with_its_summary(tmp_path, capsys):
    """The README's main job (`python train.py`, its own data, model and schedule) at a CI size: its last lines
    give held-out token agreement vs "nothing moves" vs the ceiling, the verdict the numbers say, where the videos
    are and the next commands on the real checkpoint. (At full size the verdict is that it beats "nothing moves":
    BENCHMARKS.md, the main job.)"""
    from mcar.tools.train import main as train
    from tests.conftest import job_overrides, run_in_process

    first = re.search(r"^    python -m venv .*", (REPO / "README.md").read_text(), flags=re.M).group(0)
    assert first.endswith("&& python train.py"), first
    run_in_process(train, *job_overrides(tmp_path), f"paths.data_dir={tmp_path}/data", "logger=none",
                   "data.episodes=3", "data.frames_per_episode=12", "data.val_episodes=1", "data.workers=1",
                   "trainer.max_steps=2", "val_dashboard.min_steps=0")  # sampled and measured at any length
    out = capsys.readouterr().out
    summary = out[out.index("== train done"):].splitlines()
    model, still, ceiling = (float(re.search(rf"^  {name} +([0-9.]+)", "\n".join(summary), flags=re.M).group(1))
                             for name in ("this model", "nothing moves", "ceiling"))
    assert 0 <= model <= 1 and 0 <= still <= 1 and ceiling == 1.0, summary
    verdict = next(line for line in summary if line.startswith("  -> "))
    assert ("does not beat" in verdict) == (model <= still), summary
    ckpt = next(line for line in summary if line.startswith("checkpoint: ")).split(": ", 1)[1]
    assert Path(ckpt).is_file() and Path(ckpt).name == "last.ckpt"
    videos = next(line for line in summary if line.startswith("videos"))
    assert list(Path(videos.rsplit(": ", 1)[1]).glob("val_step*.gif")), videos
    commands = [line.split(":", 1)[1].strip() for line in summary[summary.index("next:") + 1:]]
    starts = ["python finetune.py", "mcar generate", "mcar evaluate", "pip install -e '.[play]' && mcar play"]
    assert len(commands) == len(starts) and all(c.startswith(s) for c, s in zip(commands, starts)), commands
    assert all(str(Path(ckpt).parent) in c for c in commands), commands
