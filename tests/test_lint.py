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
