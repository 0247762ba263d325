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
    assert [t for _, t in tools] == ["generate", "evaluate", "play"] and all(m == "mcar" for m, _ in tools)
    assert all("checkpoints/shipped/crafter_tiles_diagd" in c and "data=" not in c for c in newcomer_commands())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs git and a checkout")
def test_a_fresh_clone_runs_the_shipped_model_commands_without_building_data(tmp_path):
    clone = tmp_path / "mcar"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    if not (clone / "checkpoints" / "shipped" / "crafter_tiles_diagd" / "held_out").is_dir():
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
    bench, = (clone / "outputs" / "play").glob("*/play_bench.json")
    assert all(r["frames_per_s"] > 0 for r in json.loads(bench.read_text())["ks"].values())
