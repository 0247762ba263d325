"""Benchmarks: sampler, training, memory and data speed, the staged GPU check. Above eval and train, which they
measure; below the tools (`mcar bench`)."""
