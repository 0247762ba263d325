"""mcar: train, fine-tune and sample MC-AR world models (LLaMA decoder, 3D RoPE, Diagonal Decoding)."""

__version__ = "0.1.0"
