"""Post-training starts from Crafter (`mcar posttrain`: the source of mcar.data.starts.StartsDataModule): fresh
worlds played by a policy, tokenised by the data's VQ. World seeds are never a training episode's (those come from
the generator's seed, `data.gen_seed`, drawing their own world seeds). Each world is played by a policy drawn from
`policy_mix` (crafter_gen's policies; `recall` gives the explorer and the wanderer their recall plans, data.recall's
settings; `placing` has the wanderer place tables and furnaces and walk into them, data.placing's settings) for a
random warm-up of up to `warmup` steps, then `clips_per_world` x `frames` steps: each run of `frames` frames and
their actions is the true clip a rollout from its prompt frames is scored against (Crafter is the simulator: the
true next frames under the same actions). Building a world costs seconds, more than a step's rollouts on a small
model: one world gives several clips. A world whose player dies first is skipped and counted, and the next seed
taken in its place.
"""
from __future__ import annotations

import numpy as np
import torch

from mcar.core.layout import Layout
from mcar.crafter.env import CrafterEnv
from mcar.crafter.gen import POLICIES, make_policy, placing_settings, recall_settings
from mcar.tokenizer.clips import join_clip
from mcar.tokenizer.vq_model import encode_tokens, frame_size, load_vq


class CrafterStarts:
    """World seed -> its true clips with the player's positions (CrafterStarts.__call__), [] when the player dies
    before the end."""

    def __init__(self, layout: Layout, codebook_size: int, frames: int, vq_path: str | None, view, daylight,
                 policy_mix: dict, warmup: int = 16, clips_per_world: int = 1, recall: dict | None = None,
                 placing: dict | None = None):
        if not policy_mix or any(k not in POLICIES for k in policy_mix):
            raise ValueError(f"starts.policy_mix={dict(policy_mix)}: weights over {sorted(POLICIES)}")
        if view is None or list(view) != [layout.w, layout.h]:
            raise ValueError(f"data.view={None if view is None else list(view)}: post-training starts need the "
                             f"tile-exact setting (view [{layout.w}, {layout.h}]: one tile per token)")
        if clips_per_world < 1:
            raise ValueError(f"starts.clips_per_world={clips_per_world}: at least 1")
        self.layout, self.codebook_size, self.frames, self.warmup = layout, codebook_size, frames, warmup
        self.clips_per_world = clips_per_world
        self.recall = recall_settings(recall)  # a bad setting fails here, naming it
        self.placing = placing_settings(placing)
        self.vq = load_vq(vq_path)
        self.size = frame_size(self.vq, layout.h, layout.w)
        self.view, self.daylight = tuple(int(v) for v in view), daylight
        self.names = sorted(policy_mix)
        p = np.array([float(policy_mix[n]) for n in self.names])
        self.p = p / p.sum()
        self.dead = 0  # worlds skipped: the player died before the clip's end

    def __call__(self, world_seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The world's true clips, each with the player's world (x, y) at each of its frames ((frames * frame_len,),
        (frames, 2)); [] when the player dies first."""
        rng = np.random.default_rng(world_seed)
        policy = make_policy(self.names[rng.choice(len(self.names), p=self.p)], rng, self.recall, self.placing)
        sim = CrafterEnv(self.size, self.view, self.daylight)
        obs = sim.reset(world_seed)
        frames, actions, positions = [], [], []
        n = self.frames * self.clips_per_world
        for _ in range(int(rng.integers(0, self.warmup + 1)) + n):
            action = policy(sim.env)
            frames.append(obs)
            actions.append(action)
            positions.append(list(sim.pos))
            obs, info = sim.step(action)
            if info["done"]:
                self.dead += 1
                return []
        with torch.no_grad():
            images = encode_tokens(self.vq, torch.from_numpy(np.stack(frames[-n:])))
        clip = join_clip(images, torch.tensor(actions[-n:])[:, None], self.codebook_size)
        where = torch.tensor(positions[-n:]).view(self.clips_per_world, self.frames, 2)
        return list(zip(clip.view(self.clips_per_world, -1), where))
