"""Random LLaMA checkpoints in Hugging Face's folder format (config.json + model.safetensors), written without
transformers, and the outputs transformers computes on them: `scripts/llama_reference.py` (which needs transformers)
loads each folder into LlamaForCausalLM and stores its logits in tests/fixtures/llama_reference.pt, so the conversion
tests compare with transformers' own numbers without importing it (Lightning's torchmetrics import pulls transformers
into every process when it is installed)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from mcar.core.layout import Layout

REFERENCE = Path(__file__).parent / "fixtures" / "llama_reference.pt"
LAYOUT, FRAMES, CODES = Layout(3, 4, 2), 3, 32  # 14 slots per frame: 12 image tokens then 2 actions
GEOMETRY_LAYOUT, GEOMETRY_FRAMES = Layout(14, 24, 11), 16  # MineWorld's frames: 16 x 347 = 5,552 slots
GEOMETRY_ROWS = slice(None, None, 16)  # the geometry logits kept: every 16th slot (the last ones drift first)


def tiny_config(tie: bool = False) -> dict:
    """MineWorld's config shape (GQA, 1D RoPE, SwiGLU, no biases) at test size."""
    return llama_config(vocab_size=CODES + 8, hidden_size=64, intermediate_size=96, num_attention_heads=8,
                        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=LAYOUT.n_slots(FRAMES),
                        rope_theta=1000.0, tie_word_embeddings=tie)


def geometry_config() -> dict:
    """One layer at MineWorld's head_dim (64) over its 16-frame length."""
    return llama_config(vocab_size=CODES + 8, hidden_size=128, intermediate_size=192, num_attention_heads=2,
                        num_key_value_heads=1, num_hidden_layers=1,
                        max_position_embeddings=GEOMETRY_LAYOUT.n_slots(GEOMETRY_FRAMES), rope_theta=10000.0,
                        tie_word_embeddings=False)


def llama_config(**fields) -> dict:
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
                attention_bias=False, mlp_bias=False, head_dim=fields["hidden_size"] // fields["num_attention_heads"],
                torch_dtype="float32", **fields)


def write_llama(folder: Path, config: dict, seed: int = 0) -> Path:
    """A random LlamaForCausalLM checkpoint (weights N(0, 0.2), norms U(0.5, 1.5): a swapped norm shows) as
    save_pretrained writes it."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    D, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config["head_dim"]
    H, Hkv = config["num_attention_heads"], config["num_key_value_heads"]

    def normal(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    def norm():
        return torch.rand(D, generator=g) + 0.5

    state = {"model.embed_tokens.weight": normal(V, D)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state |= {p + "self_attn.q_proj.weight": normal(H * hd, D), p + "self_attn.k_proj.weight": normal(Hkv * hd, D),
                  p + "self_attn.v_proj.weight": normal(Hkv * hd, D), p + "self_attn.o_proj.weight": normal(D, H * hd),
                  p + "mlp.gate_proj.weight": normal(F, D), p + "mlp.up_proj.weight": normal(F, D),
                  p + "mlp.down_proj.weight": normal(D, F), p + "input_layernorm.weight": norm(),
                  p + "post_attention_layernorm.weight": norm()}
    state["model.norm.weight"] = norm()
    if not config["tie_word_embeddings"]:
        state["lm_head.weight"] = normal(V, D)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def clip(layout: Layout = LAYOUT, frames: int = FRAMES, batch: int = 2) -> torch.Tensor:
    """Image codes then action ids (CODES + 0..5), seeded."""
    g = torch.Generator().manual_seed(1)
    c = torch.randint(0, CODES, (batch, layout.n_slots(frames)), generator=g)
    act = ~layout.is_image(frames)
    c[:, act] = CODES + torch.randint(0, 6, (batch, int(act.sum())), generator=g)
    return c


def mlp_input(dim: int) -> torch.Tensor:
    return torch.randn(3, 5, dim, generator=torch.Generator().manual_seed(2))


def reference() -> dict:
    return torch.load(REFERENCE, weights_only=True)
