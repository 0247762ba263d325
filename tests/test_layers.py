"""The package's layers (pyproject.toml [tool.importlinter]): nothing imports upward; the core imports torch only."""
import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "mcar" / "core"


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports not found: pip install -e '.[test]' installs import-linter")
    p = subprocess.run([exe, "--no-cache"], capture_output=True, text=True, cwd=CORE.parents[1])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module)
    return roots


def test_core_imports_only_torch_and_the_standard_library():
    """Stricter than the forbidden contract (a list): every import of mcar/core is stdlib, torch or the core."""
    files = sorted(CORE.glob("*.py"))
    assert {f.stem for f in files} >= {"layout", "rope", "model", "visibility", "schedule", "masks", "sampler"}
    bad = {f"{f.name}: {m}" for f in files for m in imported_roots(f)
           if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "torch"
           and not m.startswith("mcar.core")}
    assert not bad, sorted(bad)


def test_the_check_sees_a_violation(tmp_path):
    """The AST check is not vacuous: a core file importing numpy or the training layer is caught."""
    f = tmp_path / "x.py"
    f.write_text("import numpy as np\nfrom mcar.train.module import MCARModule\nfrom torch import nn\nimport math\n")
    assert imported_roots(f) == {"numpy", "mcar.train.module", "torch", "math"}
