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


def test_file_references_in_code_and_docs_point_inside_the_repository():
    """Comments and docs cite docs/*.md, tests/test_*.py and mcar/... files that exist; nothing in the package, its
    configs or its tests points at ../shared (a folder beside the developers' checkout that no user has)."""
    import pathlib

    sources = [p for d in ("mcar", "conf", "tests", "docs", "scripts") for p in (REPO / d).rglob("*")
               if p.suffix in (".py", ".yaml", ".md", ".sh")] + [REPO / "README.md", REPO / "BENCHMARKS.md"]
    cited = {}
    for path in sources:
        text = path.read_text()
        for ref in re.findall(r"\b((?:docs/[\w-]+\.md)|(?:tests/test_\w+\.py))\b", text):
            cited.setdefault(ref, path.relative_to(REPO))
        if path.name != "BENCHMARKS.md":  # BENCHMARKS.md keeps the file names its dated entries ran with
            for ref in re.findall(r"(?<![\w/.])(mcar/[\w/]+\.(?:py|yaml))\b", text):
                cited.setdefault(ref, path.relative_to(REPO))
        if path.name != pathlib.Path(__file__).name:  # README, docs, scripts too: a user has no ../shared
            assert "../shared" not in text, f"{path.relative_to(REPO)} points at ../shared"
    assert "docs/diagd.md" in cited
    missing = {ref: str(where) for ref, where in cited.items() if not (REPO / ref).exists()}
    assert not missing, f"cited but missing (file: where cited): {missing}"


def test_what_is_inside_names_every_module():
    """docs/architecture.md's "What is inside" tree names every module of the package (a new module is added to the
    map)."""
    readme = (REPO / "docs" / "architecture.md").read_text()
    start = readme.index("## What is inside")
    inside = readme[start:readme.index("\n\n", readme.index("pre-commit install", start))]  # the tree
    modules = sorted({p.stem for p in (REPO / "mcar").rglob("*.py") if p.stem != "__init__"})
    unnamed = [m for m in modules if not re.search(rf"\b{re.escape(m)}\b", inside)]
    assert not unnamed, f"docs/architecture.md's 'What is inside' does not name: {unnamed}"


def test_a_sampler_option_lives_in_the_sampler_and_its_config():
    """docs/architecture.md "Where do I add X": a sampler option is a ScheduleSampler keyword checked by
    check_settings, with its default in conf/sampler/shared.yaml; every sampler config takes it, and nothing else
    lists options."""
    import inspect

    from omegaconf import OmegaConf

    from mcar.core.sampler import ScheduleSampler, check_settings

    conf = REPO / "mcar" / "conf" / "sampler"
    shared = set(OmegaConf.load(conf / "shared.yaml"))
    given = {"self", "layout", "frames", "prompt_frames", "schedule", "name", "schedule_fields",
             "codebook_size"}  # the clip, the schedule group and the data's codebook: not sampler options
    own = set(inspect.signature(ScheduleSampler.__init__).parameters) - given
    assert shared == own, f"conf/sampler/shared.yaml and ScheduleSampler differ: {sorted(shared ^ own)}"
    checked = set(inspect.signature(check_settings).parameters) - {"_", "codebook_size"}
    assert checked <= own and {"temperature", "top_k", "top_p"} <= checked
    for option in sorted(p.stem for p in conf.glob("*.yaml") if p.stem != "shared"):
        cfg = OmegaConf.load(conf / f"{option}.yaml")
        assert list(cfg.defaults) == ["shared", "_self_"] and set(cfg) - {"defaults"} == {"name"}, option
