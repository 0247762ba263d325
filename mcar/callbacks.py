"""Lightning callbacks that use the shared samplers (the sampler itself knows nothing of Lightning)."""
from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from mcar.sampler import build_sampler


class ValGeneration(Callback):
    """After each validation: generate from the first val prompts with the configured sampler, log speed and
    token accuracy against the ground truth, and save the tokens (ground truth + generated) to disk."""

    def __init__(self, sampler: dict, output_dir: str, n_clips: int = 1, max_frames: int | None = 4):
        self.sampler_cfg, self.n_clips, self.max_frames = dict(sampler), n_clips, max_frames
        self.out = Path(output_dir) / "val_generations"

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        clips = getattr(pl_module, "val_prompts", None)
        if clips is None or trainer.sanity_checking or not trainer.is_global_zero:
            return
        lay, frames = pl_module.layout, pl_module.hparams.clip_frames
        frames = min(frames, self.max_frames or frames)
        clips = clips[: self.n_clips, : lay.n_slots(frames)]
        sampler = build_sampler(self.sampler_cfg, lay, frames)
        model = pl_module.model
        was_training = model.training
        model.eval()
        try:
            tokens, stats = sampler.generate(model, clips)
        finally:
            model.clear_cache()
            model.train(was_training)
        gen = sampler.schedule().gen_slots.to(clips.device)
        acc = (tokens[:, gen] == clips[:, gen]).float().mean()
        name = sampler.name
        pl_module.log_dict({f"val_gen/{name}_token_acc": acc, f"val_gen/{name}_passes": float(stats.passes),
                            f"val_gen/{name}_tokens_per_s": stats.tokens_per_second}, rank_zero_only=True)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save({"step": trainer.global_step, "sampler": self.sampler_cfg, "frames": frames,
                    "layout": vars(lay), "ground_truth": clips.cpu(), "generated": tokens.cpu(),
                    "passes": stats.passes, "seconds": stats.seconds},
                   self.out / f"step{trainer.global_step:07d}_{name}.pt")
