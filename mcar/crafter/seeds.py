"""The world tests' fresh worlds against every world a checkpoint was trained on, and the players it saw.

A world test plays Crafter seeds `seed_base .. seed_base + 20 * starts + 19` (a world where a walk cannot be made
is skipped, 20 tries per start). None of them may be a world the checkpoint trained in: its data's episodes (every
world seed an episode of its generator seed can have, whatever the policy: mcar.crafter.gen.training_world_seeds)
and its post-training worlds (from its `posttrain.data.seed_base`, `posttrain.starts` x 4 a step, for up to
MAX_RANKS ranks). A policy is `seen` when the checkpoint's data or post-training played it.
"""
from __future__ import annotations

from mcar.crafter.gen import training_world_seeds

MAX_RANKS = 64  # post-training's worlds are counted for up to this many ranks (each rank takes its own seeds)


def worlds_a_test_plays(seed_base: int, starts: int) -> range:
    """The Crafter seeds a world test of `starts` starts from `seed_base` may play."""
    return range(int(seed_base), int(seed_base) + 20 * int(starts) + 20)


def posttrain_worlds(hp: dict) -> range | None:
    """The Crafter seeds post-training may have played (mcar.data.starts.StartsDataModule: step s of rank r takes
    `seed_base + (s * world + r) * 4 * starts` on), None for a checkpoint that was not post-trained."""
    post = hp.get("posttrain")
    if not post:
        return None
    data = post.get("data") or {}
    if "seed_base" not in data:
        raise ValueError("the checkpoint's hyper_parameters.posttrain has no data.seed_base: which worlds it "
                         "post-trained on is unknown (re-save it with its posttrain.data config)")
    first = int(data["seed_base"])
    return range(first, first + int(hp["max_steps"]) * MAX_RANKS * 4 * int(post["starts"]))


def check_fresh_worlds(seed_base: int, starts: int, hp: dict) -> dict:
    """-> what the test's worlds were checked against; a ValueError naming seed_base when one of them is a world
    the checkpoint trained or post-trained in."""
    mine = worlds_a_test_plays(seed_base, starts)
    data = hp.get("data") or {}
    report = {"worlds": [mine.start, mine.stop - 1]}
    if data.get("gen_seed") is not None and data.get("episodes") is not None:
        trained = training_world_seeds(int(data["gen_seed"]), int(data["episodes"]))
        report["training_worlds"] = len(trained)
        report["training_episodes"] = int(data["episodes"])
        clash = sorted(s for s in trained if s in mine)
        if clash:
            raise ValueError(f"seed_base={seed_base}: world {clash[0]} is one of the checkpoint's training episodes' "
                             f"worlds (data.gen_seed={data['gen_seed']}, {data['episodes']} episodes): choose a "
                             f"seed_base whose {len(mine)} worlds avoid it")
    post = posttrain_worlds(hp)
    if post is not None:
        report["posttrain_worlds"] = [post.start, post.stop - 1]
        if mine.start < post.stop and post.start < mine.stop:
            raise ValueError(f"seed_base={seed_base}: worlds {mine.start}..{mine.stop - 1} overlap the checkpoint's "
                             f"post-training worlds {post.start}..{post.stop - 1}: choose a seed_base below "
                             f"{post.start - len(mine) + 1} or from {post.stop}")
    return report


def seen_policies(hp: dict) -> set[str]:
    """The policies the checkpoint's data (data.policy_mix) or its post-training worlds played (weight > 0)."""
    mixes = [(hp.get("data") or {}).get("policy_mix") or {},
             (((hp.get("posttrain") or {}).get("data") or {}).get("source") or {}).get("policy_mix") or {}]
    return {str(name) for mix in mixes for name, w in dict(mix).items() if float(w) > 0}
