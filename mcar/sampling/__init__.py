"""Sampling a trained world model: a checkpoint ready to sample (`world_model.WorldModel`: model, layout, VQ,
device and the one window default), the held-out clips and prompts it samples from, and play's engine (games
stepped frame by frame, the games that step together batched). Below eval and train, which both use it."""
