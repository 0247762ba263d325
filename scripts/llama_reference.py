"""Regenerate tests/fixtures/llama_reference.pt: transformers' outputs on the random LLaMA folders of
tests/llama_reference.py (needs `pip install -e '.[convert]'`; run after a transformers upgrade you want to check):

    python scripts/llama_reference.py
"""
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.llama_reference import (  # noqa: E402
    GEOMETRY_FRAMES,
    GEOMETRY_LAYOUT,
    GEOMETRY_ROWS,
    REFERENCE,
    clip,
    geometry_config,
    mlp_input,
    tiny_config,
    write_llama,
)


def load(folder: Path):
    return transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()


@torch.no_grad()
def main() -> None:
    out = {"transformers_version": transformers.__version__, "torch_version": str(torch.__version__)}
    with tempfile.TemporaryDirectory() as tmp:
        for tie in (False, True):
            hf = load(write_llama(Path(tmp) / f"tiny_{tie}", tiny_config(tie)))
            x = clip()
            out[f"tiny_logits_tie_{tie}"] = hf(input_ids=x, position_ids=torch.arange(x.shape[1])[None]
                                               .expand_as(x)).logits
            if not tie:
                out["tiny_mlp"] = torch.stack([layer.mlp(mlp_input(hf.config.hidden_size))
                                               for layer in hf.model.layers])
        hf = load(write_llama(Path(tmp) / "geometry", geometry_config()))
        x = clip(GEOMETRY_LAYOUT, GEOMETRY_FRAMES, batch=1)
        logits = hf(input_ids=x, position_ids=torch.arange(x.shape[1])[None]).logits
        out["geometry_logits"] = logits[0, GEOMETRY_ROWS].clone()
    slots = GEOMETRY_LAYOUT.n_slots(GEOMETRY_FRAMES)
    rope = LlamaRotaryEmbedding(transformers.LlamaConfig(hidden_size=2048, num_attention_heads=32,
                                                         max_position_embeddings=slots, rope_theta=10000.0))
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), torch.arange(slots)[None])
    out |= {"rope_inv_freq": rope.inv_freq.clone(), "rope_cos": cos[0, ::16, :32].clone(),
            "rope_sin": sin[0, ::16, :32].clone()}
    REFERENCE.parent.mkdir(exist_ok=True)
    torch.save(out, REFERENCE)
    print(f"{REFERENCE}: transformers {transformers.__version__}, {len(out)} entries")


if __name__ == "__main__":
    main()
