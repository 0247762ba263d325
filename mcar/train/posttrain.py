"""Post-training on the model's own rollouts: GRPO with verifiable rewards (`mcar posttrain`, conf/posttrain.yaml).

Each step takes `starts` fresh Crafter worlds (mcar.crafter.starts: the simulator's true clips), draws
`group` rollouts from each one's prompt frames under its true actions with the run's sampler (DiagD or NTP, on the
rolling cache, so a rollout may be longer than the trained clip), scores them (mcar.train.rewards), normalises
each reward within its group, and takes a clipped policy-gradient step with a KL anchor to the starting model
(mcar.core.policy). The log-probability of a rollout is one teacher-forced pass under the sampler's own mask:
exact, by the parity property. With `updates_per_batch` > 1 the rollouts of one step are reused for that many
optimiser steps (their sampling log-probabilities are the importance ratio's denominator). `supervised_coef` > 0
adds the same worlds' true clips, teacher-forced on the sampler's schedule and window, to the loss with that weight
(InstructGPT's PPO-ptx: the simulator's own frames beside the rewarded rollouts).

The model is the pre-trained one's (a plain Transformer under `model.`); the reference is read from `reference`
(the checkpoint post-training starts from) and kept out of the checkpoints.
"""
from __future__ import annotations

import logging
from pathlib import Path

import hydra
import lightning as L
import torch

from mcar.checkpoint.io import load_checkpoint
from mcar.checkpoint.load import transformer_of
from mcar.core.keyed_rng import seed_key
from mcar.core.model import Transformer
from mcar.core.policy import RolloutScorer, group_advantages, grpo_loss
from mcar.core.sampler import SamplingRule, build_sampler
from mcar.tokenizer.pictures import comparison_frames, write_video
from mcar.tokenizer.vq_model import load_vq
from mcar.train.module import LossWatch, MCARModule
from mcar.train.rewards import RewardTerm, Rollouts, total_reward
from mcar.wandb_run import log_media, run_of

log = logging.getLogger("mcar")
LOGP_GAP_TOL = 1e-4  # float32 CPU: a fresh rollout's log-probs, trainer vs sampler (2-5e-8 measured)


def reward_terms(rewards: dict) -> list[RewardTerm]:
    """posttrain.rewards {name: {_target_, weight, ...}} (null entries dropped) -> the terms, instantiated."""
    terms = []
    for name, node in (rewards or {}).items():
        if node is None:
            continue
        node = dict(node)
        if "weight" not in node:
            raise ValueError(f"posttrain.rewards.{name}.weight is missing: every term has a weight (0: logged only)")
        weight = float(node.pop("weight"))
        terms.append(RewardTerm(name, hydra.utils.instantiate(node, _convert_="all"), weight))
    if not any(t.weight for t in terms):
        raise ValueError("posttrain.rewards: no term has a non-zero weight: nothing to learn from")
    return terms


class PostTrainModule(MCARModule):
    def __init__(self, posttrain: dict, sampler: dict, reference: str | None = None, **module_args):
        """posttrain: conf/posttrain.yaml's `posttrain` node; sampler: the run's sampler group (temperature > 0:
        a rollout needs a distribution); reference: the checkpoint whose weights anchor the KL (null: no KL term,
        posttrain.kl_coef must be 0). The other arguments are MCARModule's."""
        super().__init__(**module_args)
        p = self.post = dict(posttrain)
        if p.get("objective", "grpo") not in ("grpo", "supervised"):
            raise ValueError(f"posttrain.objective={p.get('objective')!r}: grpo (rollouts and rewards) or supervised "
                             f"(the control: the same worlds' true clips, teacher-forced)")
        self.group, self.frames = int(p["group"]), int(p["rollout_frames"])
        self.supervised_coef = float(p.get("supervised_coef") or 0.0)
        if self.supervised_coef < 0:
            raise ValueError(f"posttrain.supervised_coef={self.supervised_coef}: a weight >= 0 (0: GRPO alone)")
        if self.group < 2:
            raise ValueError(f"posttrain.group={self.group}: GRPO compares rollouts of one start, at least 2")
        context = sampler.get("context") or self.hparams.clip_frames  # the window every sampling tool takes
        if self.frames < 2 or context < 2:
            raise ValueError(f"posttrain.rollout_frames={self.frames}, sampler.context={context}: at least 2 frames "
                             f"each")
        self.context = context
        sampler = {**dict(sampler), "context": context, "compile": False}
        if float(sampler.get("temperature", 1.0)) <= 0 or sampler.get("top_k") == 1:
            raise ValueError("sampler.temperature=0 / top_k=1 (greedy) has no distribution to improve: post-training "
                             "samples at temperature > 0")
        cut = [f"sampler.{k}={sampler[k]}" for k in ("top_k", "top_p", "min_p") if sampler.get(k)]
        if cut:  # a drawn token the updated model or the anchor cuts has log-probability -inf: a NaN loss
            raise ValueError(f"{cut[0]}: post-training samples from the whole distribution (a cut rule gives tokens "
                             f"the updated model or the KL anchor cuts no probability); drop it here, sample under "
                             f"it in play")
        data = self.hparams.data or {}
        self.codebook_size = int(data.get("codebook_size") or self.hparams.arch["vocab_size"])
        self.sampler = build_sampler(sampler, self.layout, self.frames, self.codebook_size, self.schedule)
        self.scorer = RolloutScorer(self.layout, self.frames, self.sampler.config, context, self.sampler.full)
        self.terms = reward_terms(p.get("rewards"))
        if reference is None and float(p["kl_coef"]):
            raise ValueError("posttrain.kl_coef > 0 needs a reference checkpoint (init_from)")
        self._reference: list[Transformer] = []  # a list: kept out of the state dict and the optimiser
        self._rollouts: dict | None = None  # the batch being reused (updates_per_batch > 1)
        self._gap_warned = False

    # --- the reference model ------------------------------------------------------------------------------
    def reference(self) -> Transformer | None:
        path = self.hparams.reference
        if path is None or not float(self.post["kl_coef"]):
            return None
        if not self._reference:
            ref = transformer_of(self.hparams.arch, load_checkpoint(path)["state_dict"])
            self._reference.append(ref.requires_grad_(False))
        return self._reference[0].to(self.device)

    # --- rollouts -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def rollouts(self, real: torch.Tensor, step: int, positions: torch.Tensor | None = None) -> dict:
        """`group` rollouts of each true clip (B, N) -> the generated clips, their log-probabilities as drawn, the
        rewards and advantages; positions (B, T, 2): the player's, for rewards that need them. Noise keys are (step,
        row) and the run's seed (`posttrain.seed`): a fresh draw every step, the same on a resumed run."""
        clips = real.repeat_interleave(self.group, 0)
        keys = torch.arange(len(clips), device=clips.device) + (step + 1) * 1_000_003
        seed = int(self.post.get("seed") or 0)
        if seed:  # seed 0 adds nothing, so the shipped models' recipes draw what they drew
            keys = keys ^ seed_key(seed)
        was_training = self.model.training
        self.model.eval()
        try:
            rolled = self.sampler.roll(self.model, clips, noise_keys=keys, logprobs=True)
        finally:
            self.model.swap_caches(None)  # the cache is a rollout's only: its memory back to training
            self.model.train(was_training)
        batch = Rollouts(rolled.tokens, clips, self.layout, self.codebook_size, self.sampler.prompt_frames,
                         None if positions is None else positions.repeat_interleave(self.group, 0),
                         self.context)
        total, terms = total_reward(self.terms, batch)
        rule = self.rule(clips.device)
        ref = self.reference()
        ref_logp = None if ref is None else self.scorer(ref, rolled.tokens, rule).float()
        return dict(tokens=rolled.tokens, old_logp=rolled.logprobs.float(), ref_logp=ref_logp, reward=total,
                    terms=terms, advantages=group_advantages(total, self.group))

    def rule(self, device) -> SamplingRule:
        return self.sampler.sampling_rule(device)  # the rule the rollouts were drawn under

    # --- the step -------------------------------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if self.post.get("objective", "grpo") == "supervised":
            return self.supervised_step(batch)
        step, every = self.global_step, int(self.post.get("updates_per_batch") or 1)
        if self._rollouts is None or step % every == 0:
            self._rollouts = self.rollouts(batch["tokens"], step, batch.get("positions"))
        r = self._rollouts
        logp = self.scorer(self.model, r["tokens"], self.rule(r["tokens"].device))
        out = grpo_loss(logp, r["old_logp"], r["ref_logp"], r["advantages"], self.scorer.generated_mask(logp.device),
                        float(self.post["clip_eps"]), float(self.post["kl_coef"]))
        loss = out.loss
        if self.supervised_coef:
            supervised = self.true_clip_nll(batch["tokens"])
            loss = loss + self.supervised_coef * supervised
            self.log("train/supervised", supervised.detach())
        if self._loss_watch is None:
            self._loss_watch = LossWatch(deferred=loss.is_cuda)
        self._loss_watch.push(loss, step)
        self._stop_on_non_finite_loss()
        gen = self.scorer.generated_mask(logp.device)
        gap = (logp.detach() - r["old_logp"]).abs()[:, gen].mean()
        if step % every == 0 and not self._gap_warned and logp.device.type == "cpu" and \
                self.model.output.weight.dtype == torch.float32 and gap.item() > LOGP_GAP_TOL:
            self._gap_warned = True  # fresh rollouts, float32: the parity property says ~1e-7
            log.warning("posttrain: at step %d the trainer's and the sampler's log-probabilities of fresh rollouts "
                        "differ by %.2g per token (parity: ~1e-7): the rollouts were not drawn from the weights "
                        "being trained", step, gap.item())
        groups = r["reward"].view(-1, self.group)
        self.log("train/loss", loss, prog_bar=True)
        self.log_dict({"reward/std_in_group": groups.std(1).mean(),
                       **{f"reward/{k}": v.mean() for k, v in r["terms"].items()},
                       "train/kl": out.kl, "train/clip_fraction": out.clip_fraction, "train/ratio": out.ratio,
                       "train/policy": out.policy,
                       # the trainer's and the sampler's log-probabilities of the same tokens (0 up to rounding at
                       # the first update: the parity property; larger after updates on reused rollouts)
                       "train/logp_gap": gap,
                       "train/entropy_proxy": -r["old_logp"][:, gen].mean()}, prog_bar=False)
        self.log("reward/mean", r["reward"].mean(), prog_bar=True)
        if self._logs_this_step:
            self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        self.last_rollouts = r
        return loss

    def true_clip_nll(self, tokens: torch.Tensor) -> torch.Tensor:
        """The true clips (B, N) -> the mean negative log-probability the sampler (its schedule and window) gives
        their generated tokens."""
        logp = self.scorer(self.model, tokens, self.rule(tokens.device))
        return -logp[:, self.scorer.generated_mask(logp.device)].mean()

    def supervised_step(self, batch: dict) -> torch.Tensor:
        """posttrain.objective=supervised, the control: the same fresh worlds' true clips, no rollouts, the loss
        true_clip_nll: a DiagD fine-tune on the simulator's data at the cost of the same steps."""
        loss = self.true_clip_nll(batch["tokens"])
        if self._loss_watch is None:
            self._loss_watch = LossWatch(deferred=loss.is_cuda)
        self._loss_watch.push(loss, self.global_step)
        self._stop_on_non_finite_loss()
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        """Throughput in rollout tokens (the parent's counts the batch's true clips)."""
        tokens = self._rollouts["tokens"] if self._rollouts is not None else batch["tokens"]
        super().on_train_batch_end(outputs, {"tokens": tokens}, batch_idx)

    def validation_step(self, batch: dict, batch_idx: int) -> None:  # no validation set: rewards are measured
        return None


class RolloutVideos(L.Callback):
    """Every `every_n_steps` steps: the first start's true clip beside its group's rollouts (VQ-decoded) ->
    <output_dir>/rollouts/step<N>.{mp4,gif}, and to W&B as `rollouts/video`."""

    def __init__(self, output_dir: str, vq_path: str | None, every_n_steps: int = 50, action_space: str | None = None,
                 fps: float = 4, shown: int = 3):
        self.out, self.vq_path, self.every = Path(output_dir) / "rollouts", vq_path, int(every_n_steps)
        self.space, self.fps, self.shown = action_space, fps, shown
        self._vq = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or not self.every or step % self.every or not hasattr(pl_module, "last_rollouts"):
            return
        r = pl_module.last_rollouts
        if self._vq is None:
            self._vq = load_vq(self.vq_path)
        clips = {"simulator": batch["tokens"][0]}
        for i in range(min(self.shown, pl_module.group)):
            clips[f"rollout {i} (reward {float(r['reward'][i]):.2f})"] = r["tokens"][i]
        video = comparison_frames(clips, pl_module.layout, pl_module.codebook_size, self._vq, self.space)
        path = write_video(video, self.out / f"step{step:07d}", self.fps)[1]
        run = run_of(trainer)
        if run is not None:
            log_media(run, {"rollouts/video": path})
