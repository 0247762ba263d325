"""`mcar <tool> [overrides]`: one command line for every tool (mcar/tools/<tool>.py, configured by conf/<tool>.yaml).

    mcar train model=700m                     mcar finetune mask=diagd steps=1000
    mcar generate ckpt=checkpoints/<run>      mcar bench sampler model=300m

Overrides are Hydra's (`key=value`, `group=option`, `--multirun`, `--cfg job`). `python train.py` and
`python finetune.py` are `mcar train` and `mcar finetune`; `python -m mcar.cli <tool>` is `mcar <tool>`.
"""
from __future__ import annotations

import importlib
import sys

# tool -> what it does (the modules are imported only when run: `mcar --help` stays instant)
TOOLS = {
    "train": "pre-train a world model (train.py)",
    "finetune": "fine-tune a checkpoint, e.g. with the DiagD mask (finetune.py)",
    "posttrain": "GRPO on the model's own rollouts, rewarded against the Crafter simulator (posttrain.py)",
    "generate": "generate a clip from a checkpoint: mp4 + gif next to the ground truth",
    "evaluate": "score samplers on held-out clips: FVD, PSNR, SSIM, LPIPS, action F1, speed",
    "worldtest": "memory, collisions and long rollouts on fresh Crafter worlds (tile-exact data)",
    "gametest": "long rollouts on fresh games of any Gymnasium env, per policy, against nothing moves",
    "play": "play a checkpoint in the browser, keys as actions (needs gradio)",
    "bench": "speed and memory: bench sampler|train|memory|gpu|play|serve",
    "idm": "train the inverse dynamics model that evaluate's action F1 uses",
    "table3": "the paper's table 3 pipeline: pre-train, fine-tune, evaluate, write the table",
    "convert": "convert a public checkpoint (MineWorld) into an mcar checkpoint",
    "soak": "kill -9 a training run at random moments and check it resumes bit for bit",
    "crafter_gen": "play seeded Crafter episodes into mp4 + jsonl",
    "record": "play any Gymnasium game into a recordings folder (mp4 + jsonl + actions.yaml)",
    "tokenize": "VQ-tokenise episodes into token shards",
    "vq_train": "train a VQ tokenizer on episodes",
    "vq_eval": "score a VQ on held-out frames: PSNR, SSIM, codebook usage",
    "vq_patches": "fit the exact patch VQ of Crafter's tiles",
}


def usage() -> str:
    width = max(map(len, TOOLS))
    return ("usage: mcar <tool> [overrides]\n\n" + "\n".join(f"  {n:<{width}}  {what}" for n, what in TOOLS.items())
            + "\n\n`mcar <tool> --help` shows a tool's config (conf/<tool>.yaml) and how to override it.")


def main(argv: list[str] | None = None) -> None:
    """Run one tool. Returns None, so that the `mcar` script exits 0 (a tool's summary dict, returned to it,
    would make `sys.exit` print it and exit 1)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return
    name, rest = args[0], args[1:]
    if name not in TOOLS:
        sys.exit(f"mcar: no tool {name!r}\n\n{usage()}")
    from mcar.hydra_app import CONF_DIR, plain_errors
    from mcar.progress import readable_progress
    from mcar.stopping import stop_signals_end
    from mcar.tool_help import usage_exit

    if any(a in ("-h", "--help") for a in rest) and (CONF_DIR / f"{name}.yaml").is_file():
        usage_exit(name)  # the tool's keys from its conf file, before the tool (and torch) is imported

    # the tools that compose their config themselves get these here (hydra_tool's get them inside Hydra too)
    with readable_progress(), plain_errors(), stop_signals_end(name):
        importlib.import_module(f"mcar.tools.{name}").main(rest)


if __name__ == "__main__":
    main()
