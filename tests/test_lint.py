"""ruff (lint + import order, pyproject.toml's [tool.ruff]) is clean on the tree: CI runs it here."""
import shutil
import subprocess
import sys

from tests.conftest import REPO


def test_ruff_is_clean_on_the_tree():
    ruff = shutil.which("ruff") or [sys.executable, "-m", "ruff"]
    cmd = [ruff] if isinstance(ruff, str) else ruff
    p = subprocess.run([*cmd, "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]


def test_ruff_reads_every_package_folder():
    """An exclude pattern like `data` (meant for the repo's data/) silently skipped mcar/data/ once."""
    ruff = shutil.which("ruff")
    cmd = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    shown = subprocess.run([*cmd, "check", "--show-files", "."], cwd=REPO, capture_output=True, text=True).stdout
    for folder in sorted(p for p in (REPO / "mcar").iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        assert f"{folder}/__init__.py" in shown, f"ruff does not read {folder.relative_to(REPO)}"
