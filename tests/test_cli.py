"""The one command line: `mcar <tool>` dispatches to mcar/tools/<tool>.py, a mistyped override gets a did-you-mean,
`mcar <tool> --help` exits 0, and a built wheel (conf/ inside the package) runs a tool from a fresh venv, away from
the repository."""
import json
import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from mcar import cli
from mcar.hydra_app import compose_tool
from tests.conftest import REPO, SMALL_DATA, run_in_process, script_env

TOOLS_DIR = REPO / "mcar" / "tools"


def train_as_users_run_it(*overrides: str):
    """mcar train in this process (run_in_process), without HYDRA_FULL_ERROR: errors are said as users see them."""
    from mcar.tools import train

    def main(args):
        os.environ.pop("HYDRA_FULL_ERROR", None)
        return train.main(args)

    return run_in_process(main, *overrides)


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


def test_compose_tool_names_a_missing_key_and_the_key_meant():
    cfg = compose_tool("crafter_gen", ["out=d", "size=[224,384]", "lossless=true"])
    assert list(cfg.size) == [224, 384] and cfg.lossless is True
    with pytest.raises(SystemExit, match="size=..."):
        compose_tool("crafter_gen", ["out=d"])
    with pytest.raises(SystemExit, match=r"^mcar crafter_gen: episdes=3: .* no key episdes; did you mean episodes\?$"):
        compose_tool("crafter_gen", ["out=d", "size=[2,2]", "episdes=3"])


@pytest.mark.parametrize("override, said", [
    ("trainer.max_step=5", "did you mean trainer.max_steps?"),
    ("optim.warmup_steps=5", "lr_schedule.warmup_steps"),  # a key that lives in another group now
    ("model=70m", "did you mean model=700m? (options: 1.2b, 300m, 700m, "),
])
def test_a_mistyped_override_gets_one_line_with_the_key_or_option_meant(override, said, tmp_path, monkeypatch):
    """Hydra said `To append to your config use +trainer.max_step=5` (wrong advice for a typo) over five lines;
    the failed composition is said in one line, before any run folder is made."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        train_as_users_run_it(*SMALL_DATA, override)
    message = str(stop.value.code)
    assert said in message and "\n" not in message and "+" not in message.replace("1.2b", "")
    assert message.startswith(f"mcar train: {override}: ") and not (tmp_path / "outputs").exists()


def test_a_command_refused_before_training_leaves_no_run_folder(tmp_path, monkeypatch):
    """Refused in the job (trainer.max_steps=0), and refused after the run took its folders (a trainer that cannot
    be built): neither outputs/train/<time>/ nor checkpoints/<run>/ stays behind."""
    monkeypatch.chdir(tmp_path)
    for bad in ("trainer.max_steps=0", "trainer.accelerator=abacus"):
        with pytest.raises(SystemExit):
            train_as_users_run_it(*SMALL_DATA, "logger=none", f"paths.checkpoint_root={tmp_path}/ckpt", bad)
        assert not (tmp_path / "outputs").exists(), bad  # outputs/train/ too: this run was all it held
        assert not (tmp_path / "ckpt").exists() or list((tmp_path / "ckpt").iterdir()) == [], bad


@pytest.mark.parametrize("tool", ["convert", "crafter_gen", "tokenize", "vq_eval", "vq_patches", "soak", "table3"])
def test_every_tools_help_exits_0(tool, capsys):
    """The tools that read their own command line (the others are Hydra apps: Hydra's --help exits 0)."""
    try:
        cli.main([tool, "--help"])
    except SystemExit as e:
        assert e.code in (0, None), e.code
    assert f"mcar {tool}" in capsys.readouterr().out


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


def test_runs_started_in_the_same_second_get_their_own_default_folders():
    """Hydra's default run and sweep folders carry microseconds: a second run started in the same second as
    another gets a folder of its own instead of being refused at the first run's."""
    import datetime
    import re

    from omegaconf import OmegaConf

    a = datetime.datetime(2026, 11, 28, 5, 1, 2, 100)
    b = a + datetime.timedelta(microseconds=1)
    for path in sorted((REPO / "mcar" / "conf").glob("*.yaml")):
        dirs = OmegaConf.to_container(OmegaConf.load(path)).get("hydra", {})
        for kind in ("run", "sweep"):
            pattern = (dirs.get(kind) or {}).get("dir")
            if pattern and "${now:" in pattern:
                fmt = re.search(r"\$\{now:([^}]*)\}", pattern).group(1)
                assert a.strftime(fmt) != b.strftime(fmt), f"{path.name}: hydra.{kind}.dir={pattern}"


def test_a_tools_help_is_its_conf_files_keys_with_their_comments_at_once():
    """`mcar play --help`: play's own keys first (with the comments that explain them), then the sampling keys it
    builds on, then its groups and their options; read from the files, before torch is imported."""
    code = ("import sys\nfrom mcar import cli\ntry:\n    cli.main(['play', '--help'])\nexcept SystemExit as e:\n"
            "    print('exit', e.code, 'torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], env=script_env(), capture_output=True, text=True, timeout=60,
                       cwd=REPO)
    out = p.stdout
    assert out.rstrip().endswith("exit 0 False"), out + p.stderr
    own, base, groups = (out.index(s) for s in ("mcar play's own keys (conf/play.yaml)", "keys from sampling",
                                                "groups (group=option"))
    assert own < base < groups
    assert "prompt: 6  # the start frame(s)" in out[own:base] and "ckpt: null  # required" in out[base:groups]
    assert "data=crafter  (options: " in out[groups:] and "adopted from it" in out[groups:]
    assert "hydra:" not in out and "defaults:" not in out


def test_a_hydra_tools_help_is_the_same_from_its_script(capsys):
    from mcar.tools import finetune

    with pytest.raises(SystemExit) as e:
        finetune.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "mcar finetune's own keys (conf/finetune.yaml)" in out and "init_from: null  #" in out
    assert "keys from train (conf/train.yaml)" in out and "model=tiny  (options: " in out


def test_no_config_group_shares_its_name_with_a_tools_own_key():
    """`mcar tokenize source=vpt` sets a key; were `source` also a config group, Hydra would read `source=vpt` as a
    group choice and refuse it (as `mcar vq_eval vq=<folder>` was). No tool has a plain value named as a group."""
    import yaml

    conf = Path(__file__).resolve().parents[1] / "mcar" / "conf"
    groups = {p.name for p in conf.iterdir() if p.is_dir() and not p.name.startswith("_")}
    for tool in conf.glob("*.yaml"):
        keys = {k for k, v in (yaml.safe_load(tool.read_text()) or {}).items() if not isinstance(v, dict)}
        assert not keys & groups, f"{tool.name}: keys {sorted(keys & groups)} are also config groups"
