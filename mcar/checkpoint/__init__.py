"""Checkpoints: atomic saves and weights-only loads (io), a checkpoint's config adopted as data (config), a
trained model loaded for sampling as a plain module (load). Below train and eval, which both use it."""
