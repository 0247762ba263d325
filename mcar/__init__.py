"""mcar: train, fine-tune and sample MC-AR world models (LLaMA decoder, 3D RoPE, Diagonal Decoding).

    from mcar import WorldModel
    wm = WorldModel.load("checkpoints/shipped/crafter_world_recall_grpo")
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`mcar.WorldModel` imported on first use: `import mcar.core` stays torch-only and fast."""
    if name == "WorldModel":
        from mcar.sampling.world_model import WorldModel

        return WorldModel
    raise AttributeError(f"module 'mcar' has no attribute {name!r}")
