"""mcar.config_checks: every checked key's value is checked before any work, for every tool; a refusal is one line
naming the key, the value and what it takes, and leaves no run folder behind."""
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from mcar.config_checks import POLICIES, REWARDS, RULES, CheckedValueError, check_before_run, check_config, markdown

from .conftest import compose

REPO = Path(__file__).resolve().parents[1]

# (tool, the run's arguments, the bad override): each meant nothing and was taken, or failed after minutes of work
REFUSED = [
    ("posttrain", [], "posttrain.kl_coef=-1"), ("posttrain", [], "posttrain.clip_eps=-0.5"),
    ("posttrain", [], "posttrain.updates_per_batch=0"), ("posttrain", [], "posttrain.rewards.tiles.weight=nan"),
    ("posttrain", [], "posttrain.rewards.tiles.weight=-inf"),
    ("posttrain", [], "posttrain.rewards.tiles._target_=builtins.dict"),
    ("posttrain", [], "starts.policy_mix={explorer:0,random:0,wanderer:0}"), ("posttrain", [], "starts.warmup=-1"),
    ("train", [], "far_copy_weight=-1"), ("train", [], "far_copy_weight=nan"), ("train", [], "far_copy_weight=inf"),
    ("train", [], "far_copy_weight=[1,2]"), ("train", [], "far_copy_weight=abc"), ("finetune", [], "retoken=abc"),
    ("finetune", [], "grow_layers=0"), ("finetune", [], "grow_layers=abc"), ("finetune", [], "rope_base=1"),
    ("worldtest", ["ckpt=x"], "rollout_frames=100000000"), ("worldtest", ["ckpt=x"], "windows=[]"),
    ("worldtest", ["ckpt=x"], "windows=[1]"), ("train", [], "optim.lr=-1"),
    ("worldtest", ["ckpt=x"], "loop_lengths=abc"), ("train", [], "trainer.max_steps=abc"),
    ("train", ["experiment=crafter_table3_cpu"], "table3.finetune.steps=abc"), ("train", [], "optim.lr=abc"),
    ("generate", ["ckpt=x"], "frames=abc"), ("train", [], "model.arch.dim=abc"),
    ("crafter_gen", ["out=x"], "size=abc"),
]


@pytest.mark.parametrize("tool, args, bad", REFUSED, ids=[b for _, _, b in REFUSED])
def test_a_value_that_means_nothing_is_refused_in_one_line_before_the_run(tool, args, bad):
    key, value = bad.split("=", 1)
    with pytest.raises(SystemExit) as e:
        check_before_run(tool, [*args, bad])
    said = str(e.value)
    assert said.startswith(f"mcar {tool}: {key}=") and f"{key} takes " in said and "\n" not in said, said
    assert value.strip("[]").split(",")[0] in said.replace("'", "").replace(" ", ""), said


def test_a_refused_run_leaves_no_run_folder(tmp_path, monkeypatch):
    """`mcar generate frames=abc` stops at the check: Hydra never makes outputs/generate/<time>/."""
    from mcar.tools.generate import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=r"^mcar generate: frames='abc': frames takes an integer from 2 to 100000"):
        main(["ckpt=x", "frames=abc"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tool, args", [
    ("train", []), ("finetune", []), ("posttrain", []), ("generate", ["ckpt=x"]), ("evaluate", ["ckpt=x"]),
    ("worldtest", ["ckpt=x"]), ("play", ["ckpt=x"]), ("crafter_gen", ["out=x", "size=[224,384]"]),
    *[("train", [f"experiment={p.stem}"]) for p in sorted((REPO / "mcar" / "conf" / "experiment").glob("*.yaml"))],
])
def test_the_shipped_configs_pass_their_checks(tool, args):
    check_config(tool, compose(tool, args))


def test_the_checks_name_the_policies_and_rewards_mcar_has():
    """The rules' lists are the data's policies and the reward classes (the rules sit below those layers)."""
    import importlib
    import inspect

    from mcar.crafter.gen import POLICIES as policies

    assert set(POLICIES) == set(policies)
    for name, classes in REWARDS.items():
        module = importlib.import_module(name)
        assert set(classes) == {n for n, c in vars(module).items() if inspect.isclass(c) and c.__module__ ==
                                module.__name__ and "__call__" in vars(c)}, name


def test_the_docs_table_is_the_rules_table():
    """docs/checked-keys.md holds `python -m mcar.config_checks --markdown`'s table."""
    assert markdown() in (REPO / "docs" / "checked-keys.md").read_text()


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10**9, 10**9), st.floats(allow_nan=True),
                   st.text(max_size=6), st.lists(st.integers(-3, 5), max_size=3),
                   st.dictionaries(st.sampled_from([*POLICIES, "nope"]), st.floats(-1, 2), max_size=3))
CONFIGS = {"posttrain": [], "worldtest": ["ckpt=x"], "generate": ["ckpt=x"], "crafter_gen": ["out=x"],
           "play": ["ckpt=x"]}


@pytest.fixture(scope="module")
def composed():
    return {tool: compose(tool, args) for tool, args in CONFIGS.items()}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_value_of_a_checked_key_is_taken_or_refused_in_one_line(composed, data):
    tool = data.draw(st.sampled_from(sorted(CONFIGS)))
    keys = [k for k in {**RULES["*"], **RULES.get(tool, {})} if "*" not in k
            and OmegaConf.select(composed[tool], k, default="absent") != "absent"]
    key, value = data.draw(st.sampled_from(keys)), data.draw(VALUES)
    cfg = composed[tool].copy()
    OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    try:
        check_config(tool, cfg)
    except CheckedValueError as e:
        said = str(e)
        assert said.startswith(f"mcar {tool}: {key}=") and "\n" not in said and f"{key} takes " in said
        return
    if not any(word in RULES.get(tool, {}).get(key, RULES["*"].get(key)).takes for word in ("number", "integer")):
        return
    taken = OmegaConf.select(cfg, key)
    taken = OmegaConf.to_container(taken) if OmegaConf.is_config(taken) else taken
    numbers = taken if isinstance(taken, list) else list(taken.values()) if isinstance(taken, dict) else [taken]
    assert all(x is None or (not isinstance(x, (bool, str)) and math.isfinite(x)) for x in numbers), (key, taken)
