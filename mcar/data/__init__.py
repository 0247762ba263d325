"""Data sources: synthetic (tests/debug), VPT, and what every source shares (Crafter's: mcar/crafter)."""
