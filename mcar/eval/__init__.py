"""Evaluation: metrics, the inverse-dynamics model, generation + scoring + reporting of held-out clips."""
