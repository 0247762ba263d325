"""Training: the Lightning module, the Hydra task, parallelism, memory planning, the dashboard, VQ training."""
