"""`mcar crafter_gen out=... size=[H,W] [episodes=24 frames=128 ...]` (conf/crafter_gen.yaml): play Crafter
episodes into <name>.mp4 + <name>.jsonl (mcar/crafter/gen.py)."""
from mcar.crafter.gen import generate
from mcar.hydra_app import compose_tool


def main(argv: list[str] | None = None) -> None:
    c = compose_tool("crafter_gen", argv)
    from omegaconf import OmegaConf

    mix = {"random": c.random, "explorer": c.explorer} | ({"wanderer": c.wanderer} if c.wanderer else {})
    recall, placing = (None if x is None else OmegaConf.to_container(x, resolve=True) for x in (c.recall, c.placing))
    generate(c.out, int(c.episodes), int(c.frames), int(c.seed), mix, int(c.workers), size=tuple(c.size),
             view=tuple(c.view) if c.view else None, daylight=c.daylight, lossless=bool(c.lossless), recall=recall,
             placing=placing)
