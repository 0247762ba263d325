"""The LightningModule: wires the model, a mask factory and the optimiser. No model or schedule logic here."""
from __future__ import annotations

import logging
import math
import time

import lightning as L
import torch
import torch.nn.functional as F

from mcar.core.flops import peak_flops, train_flops_per_token
from mcar.core.layout import Layout
from mcar.core.masks import IGNORE, build_mask_factory
from mcar.core.model import ModelConfig, Transformer
from mcar.core.schedule import ScheduleConfig
from mcar.train.parallel import apply_activation_checkpointing, apply_compile, apply_fsdp

log = logging.getLogger("mcar")


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """lr multiplier: linear warm-up to 1, then cosine down to min_ratio at `total` steps."""
    if step < warmup:
        return (step + 1) / warmup
    if total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def masked_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over slots whose target is not IGNORE. logits (B, S, V), targets (B, S)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


class MCARModule(L.LightningModule):
    def __init__(self, arch: dict, layout: dict, clip_frames: int, mask: dict, optim: dict, max_steps: int,
                 schedule: dict | None = None, action_loss: bool = False, compile: bool = False,
                 peak_flops: float | None = None, model_name: str = "custom", activation_checkpointing: bool = False,
                 sampler: dict | None = None):
        """schedule: the run's `schedule` group. Checkpoints written before it existed kept the schedule in their
        `sampler` (DiagD) or `mask` hyperparameters: those are read then (`sampler` is otherwise unused)."""
        super().__init__()
        self.save_hyperparameters()
        self.model = Transformer(ModelConfig(**arch))
        self.layout = Layout(**layout)
        mask = dict(mask)
        if schedule is None:
            fields = ("k", "d", "proxy", "prompt_frames", "full")
            old = next((c for c in (sampler or {}, mask) if str(c.get("name", "")).startswith("diagd")), {})
            schedule = {k: old[k] for k in fields if k in old} | ({"full": True} if old.get("name") == "diagd_full"
                                                                   else {})
            mask = {k: v for k, v in mask.items() if k not in fields}
        self.schedule = ScheduleConfig.of(schedule)  # the run's one schedule: training mask, validation, sampling
        self.mask_factory = build_mask_factory(mask.pop("name"), self.layout, clip_frames, schedule=self.schedule,
                                               action_loss=action_loss, **mask)
        backend = mask.get("backend", "auto")
        self.val_mask_factory = build_mask_factory("causal", self.layout, clip_frames, action_loss=action_loss,
                                                   backend=backend)
        # by the parity property this one-pass loss equals the teacher-forced DiagD sampler's loss on the same
        # schedule: generated image tokens only (frames >= prompt_frames), no action loss
        self.val_diagd_factory = build_mask_factory("diagd", self.layout, clip_frames, schedule=self.schedule,
                                                    backend=backend, generated_only=True)
        self._t_last: float | None = None

    def configure_model(self) -> None:
        """Activation checkpointing, per-block compile and FSDP2 (trainer=fsdp), applied once, in that order."""
        if getattr(self, "_parallelized", False):
            return
        if self.hparams.activation_checkpointing:
            apply_activation_checkpointing(self.model)
        if self.hparams.compile:
            apply_compile(self.model)
        from lightning.pytorch.strategies import ModelParallelStrategy

        if self._trainer is not None and isinstance(self.trainer.strategy, ModelParallelStrategy):
            mesh = self.device_mesh
            if mesh["tensor_parallel"].size() != 1:
                raise ValueError(f"trainer.strategy.tensor_parallel_size={mesh['tensor_parallel'].size()}: mcar "
                                 f"shards with FSDP only; set it to 1 and data_parallel_size to the world size")
            bf16 = str(self.trainer.precision).startswith("bf16")
            apply_fsdp(self.model, mesh["data_parallel"], param_dtype=torch.bfloat16 if bf16 else None)
            log.info("FSDP2: %d blocks + root sharded over %d processes%s", len(self.model.layers),
                     mesh["data_parallel"].size(), " (bf16 compute, fp32 reduce)" if bf16 else "")
        self._parallelized = True

    # --- steps -------------------------------------------------------------------------------------------

    def forward_loss(self, tokens: torch.Tensor, factory=None) -> torch.Tensor:
        batch = (factory or self.mask_factory)(tokens)
        logits = self.model(batch.tokens, batch.coords, batch.mask)  # (B, S, V)
        return masked_loss(logits, batch.targets)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.forward_loss(batch["tokens"])
        if not torch.isfinite(loss):
            ckpt_dir = getattr(self.trainer.checkpoint_callback, "dirpath", None)
            raise FloatingPointError(
                f"training loss is {loss.item()} at step {self.global_step}: stopping. "
                f"The last good checkpoint is kept in {ckpt_dir}."
            )
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss = self.forward_loss(batch["tokens"], self.val_mask_factory)
        n = len(batch["tokens"])
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=n)
        diagd = self.forward_loss(batch["tokens"], self.val_diagd_factory)
        self.log("val/loss_diagd", diagd, prog_bar=True, sync_dist=True, batch_size=n)
        if batch_idx == 0:
            self.val_prompts = batch["tokens"]  # for the generation callback

    # --- throughput, grad norm ---------------------------------------------------------------------------

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip here rather than through Lightning's precision plugin, which refuses fused AdamW under mixed
        precision; bf16 has no loss scaler, so the gradients are already unscaled. Logs the norm before clipping,
        the one the clip computed (no second pass). Sharded (FSDP2) gradients are DTensors: the norm is global."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return
        if gradient_clip_val and gradient_clip_algorithm != "value":  # Lightning passes a str enum
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            if gradient_clip_val:
                torch.nn.utils.clip_grad_value_(self.parameters(), gradient_clip_val, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.log("train/grad_norm", norm)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self._t_last is None:
            self._t_last = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        dt, self._t_last = now - self._t_last, now
        tokens = batch["tokens"].numel() * self.trainer.world_size
        self.log("perf/tokens_per_s", tokens / dt)
        self.log("perf/step_ms", 1000 * dt)
        peak = peak_flops(self.device, self.hparams.peak_flops)
        if peak:
            cfg, S = self.model_config, batch["tokens"].shape[1]
            fpt = train_flops_per_token(self.num_params(embeddings=False), cfg.n_layers, cfg.dim, S,
                                        self.mask_density)
            self.log("perf/mfu", fpt * tokens / dt / (peak * self.trainer.world_size))

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig(**self.hparams.arch)

    def num_params(self, embeddings: bool = True) -> int:
        n = sum(p.numel() for p in self.model.parameters())
        return n if embeddings else n - self.model_config.vocab_size * self.model_config.dim

    @property
    def mask_density(self) -> float:
        """Fraction of (query, key) pairs the training mask keeps (attention FLOPs)."""
        if not hasattr(self, "_mask_density"):
            table = self.mask_factory.table()
            self._mask_density = table.dense().float().mean().item()
        return self._mask_density

    # --- optimiser ---------------------------------------------------------------------------------------

    def configure_optimizers(self):
        o = self.hparams.optim
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]  # norms
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
            # one kernel, no foreach temporaries (a 700M model fits in 20 GiB on CPU). Not under fp16's loss
            # scaler: a fused step unscales inside, after clipping would have seen scaled gradients.
            fused=str(self.trainer.precision) != "16-mixed" if self._trainer is not None else True,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: warmup_cosine(s, o["warmup_steps"], self.hparams.max_steps, o["min_lr_ratio"])
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
