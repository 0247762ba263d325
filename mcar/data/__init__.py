"""Data sources: synthetic (tests/debug), Crafter (the embedded default) and VPT."""
