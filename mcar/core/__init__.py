"""The core: layout, RoPE, the model, the visibility rule, the DiagD schedule, the masks and the samplers.
Imports torch and the standard library only (checked by import-linter, see pyproject.toml)."""
