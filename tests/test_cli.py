"""The one command line: `mcar <tool>` dispatches to mcar/tools/<tool>.py, the old `--flag` spellings become Hydra
overrides, and a built wheel (conf/ inside the package) runs a tool from a fresh venv, away from the repository."""
import json
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from mcar import cli
from mcar.hydra_app import compose_tool, legacy_flags
from tests.conftest import REPO, script_env

TOOLS_DIR = REPO / "mcar" / "tools"


def test_every_tool_module_is_listed_by_the_cli_and_has_a_config():
    modules = {p.stem for p in TOOLS_DIR.glob("*.py") if p.stem != "__init__"}
    assert modules == set(cli.TOOLS)
    configs = {p.stem for p in (REPO / "mcar" / "conf").glob("*.yaml")}
    assert set(cli.TOOLS) - {"table3"} <= configs  # table3 composes train.yaml with experiment=<name>


def test_cli_help_lists_every_tool_and_an_unknown_tool_is_refused(capsys):
    cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in cli.TOOLS)
    with pytest.raises(SystemExit, match="no tool 'trian'"):
        cli.main(["trian"])


@pytest.mark.parametrize("argv, expected", [
    (["--out", "d", "--episodes", "3"], ["out=d", "episodes=3"]),
    (["--size", "224", "384", "--keep-null"], ["size=[224,384]", "keep_null=true"]),
    (["--min-frames=8", "batch=4"], ["min_frames=8", "batch=4"]),
    (["eps", "--out", "o"], ["episodes=eps", "out=o"]),
])
def test_legacy_flags_become_overrides(argv, expected):
    assert legacy_flags(argv, positional=("episodes",)) == expected


def test_compose_tool_reads_both_spellings_and_names_a_missing_or_unknown_key():
    old = compose_tool("crafter_gen", ["--out", "d", "--size", "224", "384", "--lossless"])
    new = compose_tool("crafter_gen", ["out=d", "size=[224,384]", "lossless=true"])
    assert old == new and list(old.size) == [224, 384] and old.lossless is True
    with pytest.raises(SystemExit, match="size=..."):
        compose_tool("crafter_gen", ["out=d"])
    with pytest.raises(SystemExit, match="episdes"):
        compose_tool("crafter_gen", ["out=d", "size=[2,2]", "episdes=3"])


def test_a_built_wheel_runs_a_tool_from_a_fresh_venv(tmp_path):
    """conf/ ships in the wheel: `mcar bench sampler` (Hydra, pkg://mcar.conf) runs from an installed wheel in a
    folder that is not the repository. The venv borrows this environment's dependencies (torch, hydra, ...)
    through a .pth line, so nothing is downloaded; mcar itself comes from the wheel only."""
    env = {k: v for k, v in script_env().items() if k != "PYTHONPATH"}
    src = tmp_path / "src"  # a copy: setuptools builds in the source tree (build/, *.egg-info)
    shutil.copytree(REPO / "mcar", src / "mcar", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, env=env, capture_output=True)
    wheel, = (tmp_path / "dist").glob("mcar-*.whl")
    venv.create(tmp_path / "venv", with_pip=False)
    py = tmp_path / "venv" / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, env=env, capture_output=True)
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    deps = [p for p in site.getsitepackages() if "site-packages" in p]
    Path(purelib, "borrowed_deps.pth").write_text("\n".join(deps) + "\n")  # appended after the wheel's own path
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = subprocess.run([str(py), "-c", "import mcar; print(mcar.__file__)"], cwd=work, env=env,
                           check=True, capture_output=True, text=True).stdout.strip()
    assert where.startswith(str(tmp_path / "venv")), where
    p = subprocess.run([str(tmp_path / "venv" / "bin" / "mcar"), "bench", "sampler", "model=tiny", "data.h=3",
                        "data.w=4", "data.n_a=2", "data.clip_frames=3", "data.codebook_size=32",
                        "data.action_vocab_size=8", "bench.repeats=1", "bench.warmup=0", f"hydra.run.dir={work}/run"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1])["model"] == "tiny"
    assert (work / "run" / ".hydra" / "config.yaml").is_file()
