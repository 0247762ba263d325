import re

from .conftest import REPO


def readme_commands() -> list[str]:
    return re.findall(r"^    (python -m venv .*)$", (REPO / "README.md").read_text(), flags=re.M)


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one():
    main, tests = readme_commands()[:2]
    assert main.endswith("python train.py")
    assert tests.endswith("python -m pytest -q")
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci, ".ci/run must run the README's test command verbatim"
