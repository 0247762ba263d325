"""Evaluation: scoring held-out clips a WorldModel generated (metrics, the results columns, tables, W&B, videos),
the IDM as scoring loads it, and the world tests on fresh Crafter worlds."""
