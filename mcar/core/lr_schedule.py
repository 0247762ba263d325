"""Learning-rate multipliers f(step) -> factor of the configured rate, each a linear warm-up then a shape: the one
home of the schedules that training (conf/lr_schedule/), the VQ training and the inverse-dynamics model use.
Pure Python: a caller wraps one in torch.optim.lr_scheduler.LambdaLR stepped every optimiser step."""
from __future__ import annotations

import math


def warmup(step: int, warmup_steps: int) -> float:
    """Linear warm-up: (step + 1) / warmup_steps until it reaches 1 (warmup_steps <= 0: none)."""
    return (step + 1) / warmup_steps if step < warmup_steps else 1.0


def warmup_cosine(step: int, warmup_steps: int, total: int, min_lr_ratio: float) -> float:
    """Linear warm-up to 1 over `warmup_steps`, then cosine down to min_lr_ratio at `total` steps, flat after
    (conf/lr_schedule/warmup_cosine.yaml: total = trainer.max_steps)."""
    if step < warmup_steps:
        return warmup(step, warmup_steps)
    if total <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def constant(step: int, total: int, warmup_steps: int = 0) -> float:
    """Linear warm-up over `warmup_steps` (0: none), then 1 (conf/lr_schedule/constant.yaml)."""
    return warmup(step, warmup_steps)


def warmup_linear_decay(step: int, warmup_steps: int, total: int, decay_frac: float, min_lr_ratio: float) -> float:
    """Linear warm-up, flat, then a linear decay to min_lr_ratio over the last `decay_frac` of `total` steps (the
    VQ's schedule: conf/vq_train.yaml)."""
    if step < warmup_steps:
        return warmup(step, warmup_steps)
    start = total * (1 - decay_frac)
    if step < start:
        return 1.0
    return max(min_lr_ratio, 1 - (1 - min_lr_ratio) * (step - start) / max(1, total - start))
