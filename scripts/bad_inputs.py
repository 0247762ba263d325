"""Run every bad value of a checked key as a user would (`mcar <tool> ...`, in a fresh folder) and print the rows of
the bad-inputs table (BENCHMARKS.md, "Bad inputs tried"): the input, the one line it gets, and whether the run left
anything behind. A row whose command did not refuse, said more than one line, or left files says FAIL.

    python scripts/bad_inputs.py            # ~1 min on CPU: each case stops at the value check, before any work
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHIPPED = str(REPO / "checkpoints" / "shipped" / "crafter_world")
CASES = [  # (tool, the run's own arguments, the bad one)
    ("posttrain", [], "posttrain.kl_coef=-1"), ("posttrain", [], "posttrain.clip_eps=-0.5"),
    ("posttrain", [], "posttrain.updates_per_batch=0"), ("posttrain", [], "posttrain.rewards.tiles.weight=nan"),
    ("posttrain", [], "posttrain.rewards.tiles.weight=-inf"),
    ("posttrain", [], "posttrain.rewards.tiles._target_=builtins.dict"),
    ("posttrain", [], "starts.policy_mix={explorer:0,random:0,wanderer:0}"),
    ("posttrain", [], "starts.policy_mix={nope:1}"), ("posttrain", [], "starts.warmup=-1"),
    ("train", [], "far_copy_weight=-1"), ("train", [], "far_copy_weight=nan"), ("train", [], "far_copy_weight=inf"),
    ("train", [], "far_copy_weight=[1,2]"), ("train", [], "far_copy_weight=abc"), ("finetune", [], "retoken=abc"),
    ("worldtest", [f"ckpt={SHIPPED}"], "rollout_frames=100000000"), ("worldtest", [f"ckpt={SHIPPED}"], "windows=[]"),
    ("worldtest", [f"ckpt={SHIPPED}"], "loop_lengths=abc"),
    ("table3", ["experiment=crafter_table3_cpu", "--dry-run"], "table3.finetune.steps=abc"),
    ("table3", ["experiment=crafter_table3_cpu", "--dry-run"], "trainer.max_steps=abc"),
    ("train", [], "optim.lr=abc"), ("generate", [f"ckpt={SHIPPED}"], "frames=abc"),
    ("train", [], "model.arch.dim=abc"), ("crafter_gen", ["out=eps"], "size=abc"),
    ("generate", [], "ckpt=missing.ckpt"), ("play", [f"ckpt={SHIPPED}"], "port=abc"),
]


def run(tool: str, args: list[str]) -> tuple[str, list[str]]:
    """`mcar tool args` in a fresh folder -> (what it said: its exit message or its stderr, the files it left)."""
    from mcar import cli

    with tempfile.TemporaryDirectory() as folder:
        old, err = os.getcwd(), io.StringIO()
        os.chdir(folder)
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    cli.main([tool, *args])
                    said = "(ran)"
                except SystemExit as e:
                    said = e.code if isinstance(e.code, str) else err.getvalue().strip()
        finally:
            os.chdir(old)
        left = sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*"))
    return said, left


def main() -> None:
    os.environ.pop("HYDRA_FULL_ERROR", None)
    print("| input | what you get | left behind |\n| --- | --- | --- |")
    failed = 0
    for tool, args, bad in CASES:
        said, left = run(tool, [*args, bad])
        lines = [line for line in said.splitlines() if line and not line.startswith("(the traceback")]
        ok = said != "(ran)" and len(lines) == 1 and not left
        failed += not ok
        shown = " / ".join(lines).replace("|", "\\|").replace(str(REPO) + "/", "")
        print(f"| `mcar {tool} {bad}` | {'' if ok else 'FAIL: '}`{shown}` | {', '.join(left) or 'nothing'} |",
              flush=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
