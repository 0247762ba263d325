"""The LightningModule: wires the model, a mask factory and the optimiser. No model or schedule logic here.

The optimiser and the learning-rate schedule come from the config (conf/optim/, conf/lr_schedule/): each is a
`_target_` node with `_partial_: true`, kept as a plain dict in the module's hyperparameters and instantiated in
`configure_optimizers`. What stays in code: the parameter groups (weight decay on 2-D weights only), fused AdamW
unless fp16, the LambdaLR wrapper stepped every optimiser step, and `max_steps` as the schedule's length."""
from __future__ import annotations

import inspect
import logging
import time
from collections import deque

import hydra
import lightning as L
import torch

from mcar.assets import assets_by_name
from mcar.core.flops import mfu, peak_flops, train_step_flops
from mcar.core.layout import Layout
from mcar.core.masks import build_mask_factory, far_copy_slots, masked_loss, weighted_loss
from mcar.core.model import ModelConfig, Transformer, set_flex_kernel_options
from mcar.core.schedule import ScheduleConfig
from mcar.train.parallel import apply_activation_checkpointing, apply_compile, apply_fsdp

log = logging.getLogger("mcar")


class LossWatch:
    """Whether each step's training loss is finite, without a host sync per step on CUDA.

    Immediate (CPU): checked in the step itself. Deferred (CUDA): each step's flag is copied to pinned host memory
    behind an event, and read once that event has passed (a step or so later); `poll(wait=True)` reads every
    pending flag (before a checkpoint is written, so no checkpoint ever holds the weights of a non-finite step).
    `poll` returns (step, loss) of the first non-finite loss, or None."""

    def __init__(self, deferred: bool):
        self.deferred = deferred
        self.pending: deque = deque()  # (step, loss, host flag, event or None)

    def push(self, loss: torch.Tensor, step: int) -> None:
        finite = torch.isfinite(loss.detach())
        if not self.deferred:
            self.pending.append((step, loss.detach(), finite, None))
            return
        host = torch.empty((), dtype=torch.bool, pin_memory=loss.is_cuda)
        host.copy_(finite, non_blocking=True)
        event = None
        if loss.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self.pending.append((step, loss.detach(), host, event))

    def poll(self, wait: bool = False) -> tuple[int, float] | None:
        while self.pending:
            step, loss, flag, event = self.pending[0]
            if event is not None and not wait and not event.query():
                return None  # not done yet: read at a later step, never wait for it here
            if event is not None:
                event.synchronize()
            self.pending.popleft()
            if not bool(flag):
                self.pending.clear()
                return step, loss.item()
        return None


# words of torch's optimiser errors -> the config field they are about
OPTIM_FIELDS = [("learning rate", "optim.lr"), ("beta", "optim.betas"), ("weight_decay", "optim.weight_decay"),
                ("epsilon", "optim.eps")]
# the hyperparameters an optimiser must get from conf/optim/ when it takes them (never torch's defaults)
OPTIM_KEYS = ("lr", "betas", "eps", "weight_decay")


def build_optimizer(model: torch.nn.Module, optim: dict, fp16: bool = False) -> torch.optim.Optimizer:
    """The configured optimiser (`optim`: the conf/optim group, a `_partial_` node) on two parameter groups: 2-D
    weights (matmuls, embeddings) get the configured weight decay, the rest (norm gains) none. Training and
    `mcar bench train` both call it. Every hyperparameter comes from the config: one the optimiser takes (lr,
    betas, eps, weight_decay) but the config leaves out is an error, not torch's default. `fused` is decided here
    unless the config sets it: one kernel, no foreach temporaries (a 700M model fits in 20 GiB on CPU), but not
    under fp16's loss scaler (fp16: trainer.precision=16-mixed), where a fused step unscales inside, after
    clipping would have seen scaled gradients."""
    cfg = dict(optim)
    if isinstance(cfg.get("betas"), (list, tuple)):
        cfg["betas"] = tuple(cfg["betas"])
    factory = hydra.utils.instantiate(cfg, _convert_="all")
    takes = inspect.signature(factory.func).parameters
    missing = [k for k in OPTIM_KEYS if k in takes and k not in cfg]
    if missing:
        raise ValueError(f"optim.{missing[0]} is missing (conf/optim/): {factory.func.__name__} takes it, and "
                         f"every one of {', '.join(OPTIM_KEYS)} it takes comes from the config, not a default")
    extra = {}
    if "fused" in takes:
        if "fused" not in cfg:
            extra["fused"] = not fp16
        elif cfg["fused"] and fp16:
            raise ValueError("optim.fused=true under trainer.precision=16-mixed: a fused step unscales the "
                             "gradients after clipping saw them scaled; leave optim.fused unset")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norms
    try:
        return factory([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], **extra)
    except ValueError as e:  # torch's "Invalid learning rate: -1" names no config field
        field = next((f for key, f in OPTIM_FIELDS if key in str(e).lower()), "optim")
        raise ValueError(f"{field} is invalid: {e} (conf/optim/)") from e


RESIDUAL_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}  # None: the embeddings' dtype (float32 weights)


class MCARModule(L.LightningModule):
    def __init__(self, arch: dict, layout: dict, clip_frames: int, mask: dict, optim: dict, max_steps: int,
                 schedule: dict | None = None, action_loss: bool = False, compile: bool = False,
                 peak_flops: float | None = None, model_name: str = "custom", activation_checkpointing: bool = False,
                 lr_schedule: dict | None = None, data: dict | None = None, vq: dict | None = None,
                 stage: str = "train", flex_kernel_options: dict | None = None, residual_dtype: str = "float32",
                 far_copy_weight: float = 1.0, context_noise: float = 0.0):
        """Built from the config's `module` node (conf/train.yaml); every argument is a plain value or dict, so a
        checkpoint's hyperparameters rebuild the module with `MCARModule(**hp)` (mcar.eval.evaluate.load_model).

        optim: the `optim` group, a `_target_` node with `_partial_: true` called with the parameter groups;
        lr_schedule: the `lr_schedule` group, a `_partial_` lr multiplier f(step, total=max_steps) (None: a
        constant rate). schedule: the run's `schedule` group (None: ScheduleConfig's defaults).
        data, vq: the run's data and VQ configs, unused here: saved with the hyperparameters so that the tools
        that load the checkpoint start from them (mcar.checkpoint.config.adopt_checkpoint_config). stage: train
        (pre-training) or finetune, saved likewise (finetune's default init_from takes pre-training runs only).
        flex_kernel_options: flex attention's kernel options on CUDA over mcar.core.model's (e.g. {USE_TMA: true}).
        residual_dtype: float32 | bfloat16, the stream between blocks under autocast (Transformer.residual_dtype).
        far_copy_weight: the training loss's weight on the targets `far_copy_slots` finds (1: the plain mean), under
        any mask (each input row weighted by the clip slot its target is read from). context_noise: the largest share
        of image tokens replaced by random image codes in the training input (each clip its own share, uniform in
        [0, context_noise]; targets stay real): robustness to the wrong tokens of its own rollouts."""
        super().__init__()
        self.save_hyperparameters()
        self.optim_config, self.lr_schedule_config = dict(optim), lr_schedule and dict(lr_schedule)
        self.model = Transformer(ModelConfig(**arch))
        if residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"residual_dtype={residual_dtype!r}: one of {sorted(RESIDUAL_DTYPES)} (conf/train.yaml)")
        self.model.residual_dtype = RESIDUAL_DTYPES[residual_dtype]
        if context_noise and not (data or {}).get("codebook_size"):
            raise ValueError(f"context_noise={context_noise}: needs the data's codebook_size (data.codebook_size) to "
                             f"draw image codes from")
        self.layout = Layout(**layout)
        mask = dict(mask)
        set_flex_kernel_options(flex_kernel_options)  # CUDA flex only; null: the defaults
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
        self.first_batch_at: float | None = None  # when training began (None: a run refused before its first step)
        self._logs_this_step = True  # set per step in on_train_batch_start
        self._loss_watch: LossWatch | None = None

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

    def forward_loss(self, tokens: torch.Tensor, factory=None, far_copy_weight: float = 1.0,
                     context_noise: float = 0.0) -> torch.Tensor:
        factory = factory or self.mask_factory
        batch = factory(tokens)
        inputs = factory(self.noisy(tokens, context_noise)).tokens if context_noise > 0 else batch.tokens
        logits = self.model(inputs, batch.coords, batch.mask)  # (B, S, V)
        if far_copy_weight == 1.0:
            return masked_loss(logits, batch.targets)
        far = far_copy_slots(tokens, self.layout, tokens.shape[1] // self.layout.frame_len)
        # each input row weighted by the slot it predicts (DiagD: proxy rows included)
        return weighted_loss(logits, batch.targets, factory.target_weights(1.0 + (far_copy_weight - 1.0) * far))

    def noisy(self, tokens: torch.Tensor, max_share: float) -> torch.Tensor:
        """(B, N) clips with a share of their image tokens (each clip's drawn uniformly in [0, max_share]) replaced
        by uniformly drawn image codes; action tokens untouched."""
        image = self.layout.is_image(tokens.shape[1] // self.layout.frame_len).to(tokens.device)
        share = torch.rand(len(tokens), 1, device=tokens.device) * max_share
        hit = (torch.rand(tokens.shape, device=tokens.device) < share) & image
        codes = torch.randint(0, int(self.hparams.data["codebook_size"]), tokens.shape, device=tokens.device)
        return torch.where(hit, codes, tokens)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.forward_loss(batch["tokens"], far_copy_weight=float(self.hparams.get("far_copy_weight", 1.0)),
                                 context_noise=float(self.hparams.get("context_noise", 0.0)))
        if self._loss_watch is None:
            self._loss_watch = LossWatch(deferred=loss.is_cuda)
        self._loss_watch.push(loss, self.global_step)
        self._stop_on_non_finite_loss()
        self.log("train/loss", loss, prog_bar=True)
        if self._logs_this_step:  # a Python float becomes a device tensor: a host-to-device copy
            self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def _stop_on_non_finite_loss(self, wait: bool = False) -> None:
        bad = self._loss_watch.poll(wait) if self._loss_watch is not None else None
        if bad is not None:
            ckpt_dir = getattr(self._trainer and self._trainer.checkpoint_callback, "dirpath", None)
            raise FloatingPointError(f"training loss is {bad[1]} at step {bad[0]}: stopping. "
                                     f"The last good checkpoint is kept in {ckpt_dir}.")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self._stop_on_non_finite_loss(wait=True)  # deferred checks first: a checkpoint never holds NaN weights
        if "hyper_parameters" in checkpoint:  # its VQ by name, not this checkout's path (read back: relocated_asset)
            checkpoint["hyper_parameters"] = assets_by_name(dict(checkpoint["hyper_parameters"]))

    def on_train_end(self) -> None:
        self._stop_on_non_finite_loss(wait=True)

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
            self._t_last = self.first_batch_at = time.perf_counter()
        self._logs_this_step = self.writes_logs_after(self.trainer.global_step + 1)

    def writes_logs_after(self, steps_done: int) -> bool:
        """Whether Lightning writes the log line of the step that brings the run to `steps_done` optimiser steps:
        every trainer.log_every_n_steps, and when training is told to stop (its logger connector's rule, from the
        trainer's public fields). Values logged on other steps are dropped; logged Python floats (lr, throughput,
        MFU) become device tensors, a host-to-device copy that waits for the GPU, so they are logged on these
        steps only."""
        every = self.trainer.log_every_n_steps
        return bool(every) and (steps_done % every == 0 or self.trainer.should_stop)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        dt, self._t_last = now - self._t_last, now
        if not (self._logs_this_step or self.trainer.should_stop):
            return
        tokens = batch["tokens"].numel() * self.trainer.world_size
        self.log("perf/tokens_per_s", tokens / dt)
        self.log("perf/step_ms", 1000 * dt)
        peak = peak_flops(self.device, self.hparams.peak_flops)
        if peak:
            flops = self.step_flops(len(batch["tokens"])) * self.trainer.world_size
            self.log("perf/mfu", mfu(flops, dt, peak, self.trainer.world_size))

    def step_flops(self, batch_size: int) -> float:
        """FLOPs of one training step on one device: every row the mask's sequence computes (DiagD: the clip's
        slots and its proxy rows), forward and backward (mcar.core.flops)."""
        cfg = self.model_config
        return train_step_flops(self.num_params(embeddings=False), cfg.n_layers, cfg.dim, self.rows_per_clip,
                                batch_size, self.mask_density)

    @property
    def rows_per_clip(self) -> int:
        """Rows of the training mask's input sequence for one clip (the clip's slots, plus DiagD's proxies)."""
        if not hasattr(self, "_rows_per_clip"):
            self._rows_per_clip = len(self.mask_factory.table().pos)
        return self._rows_per_clip

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig(**self.hparams.arch)

    def num_params(self, embeddings: bool = True) -> int:
        return self.model.num_params(embeddings)

    @property
    def mask_density(self) -> float:
        """Fraction of (query, key) pairs the training mask keeps (attention FLOPs)."""
        if not hasattr(self, "_mask_density"):
            table = self.mask_factory.table()
            self._mask_density = table.dense().float().mean().item()
        return self._mask_density

    # --- optimiser ---------------------------------------------------------------------------------------

    def build_optimizer(self) -> torch.optim.Optimizer:
        fp16 = self._trainer is not None and str(self.trainer.precision) == "16-mixed"
        return build_optimizer(self.model, self.optim_config, fp16)

    def lr_multiplier(self):
        """step -> lr multiplier: the configured schedule over `max_steps` (trainer.max_steps), else 1."""
        if self.lr_schedule_config is None:
            return lambda step: 1.0
        fn = hydra.utils.instantiate(self.lr_schedule_config, _convert_="all")
        total = self.hparams.max_steps
        return lambda step: fn(step, total=total)

    def configure_optimizers(self):
        opt = self.build_optimizer()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_multiplier())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
