"""Convert public checkpoints into mcar checkpoints:

    mcar convert format=mineworld src=<checkpoint> out=checkpoints/<name> [model=mineworld_700m] [frames=16]

`mineworld`: MineWorld's LLaMA (transformers' LlamaForCausalLM layout: GQA, 1D RoPE, untied head) from
- a Hugging Face folder (config.json + model.safetensors, sharded safetensors or pytorch_model.bin),
- or one file: .safetensors, .bin, or MineWorld's own .ckpt ({"state_dict": {"transformer.model...": ...}}; its VQ
  keys `tokenizer.*` are left out).
The model's shape comes from config.json when there is one, else from `model=` (conf/model/<name>.yaml, e.g.
mineworld_700m), else from the weights (then `heads=` is needed). Frames are 14 x 24 image tokens + 11 actions
(`h=`, `w=`, `n_a=` override); the clip length defaults to max_position_embeddings / frame length.

The result is an mcar checkpoint (`<out>/last.ckpt`: the model's weights and hyperparameters) that
`mcar generate`, `mcar evaluate` and `mcar finetune init_from=` load. transformers is not needed to convert.
"""
from __future__ import annotations

import json
import logging
import re
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import yaml

from mcar.checkpoint.io import AtomicCheckpointIO, load_weights_only
from mcar.core.layout import Layout
from mcar.core.model import ModelConfig, Transformer
from mcar.core.schedule import ScheduleConfig
from mcar.hydra_app import CONF_DIR, compose_tool

log = logging.getLogger("mcar.convert")
MINEWORLD_LAYOUT = dict(h=14, w=24, n_a=11)  # 336 image tokens then 11 action tokens per frame, 347 slots
MINEWORLD_16F_POSITIONS = 16 * 347  # max_position_embeddings of its *_16f configs (5,552)
# LLaMA (transformers) name -> mcar name; q/k/v are concatenated into wqkv, gate/up into w13 (FUSED)
RENAMES = [(r"^model\.embed_tokens\.", "tok_embeddings."), (r"^model\.norm\.", "norm."), (r"^lm_head\.", "output."),
           (r"\.self_attn\.o_proj\.", ".attention.wo."), (r"\.mlp\.down_proj\.", ".feed_forward.w2."),
           (r"\.input_layernorm\.", ".attention_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
           (r"^model\.layers\.", "layers.")]
# mcar weight <- the LLaMA weights stacked along its output rows, in this order
FUSED = {"attention.wqkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
         "feed_forward.w13": ("mlp", ("gate_proj", "up_proj"))}
FUSED_PART = {(group, part): fused for fused, (group, parts) in FUSED.items() for part in parts}


def read_weights(src: Path) -> tuple[dict[str, torch.Tensor], dict | None, int | None]:
    """(LLaMA state dict with `model.` / `lm_head.` keys, config.json's dict or None, the max_position_embeddings
    a .ckpt records beside its weights (MineWorld's hyper-parameters) or None) from a folder or a file."""
    files, config = _weight_files(src)
    state, recorded = _load_state(files)
    return _llama_weights(src, state), config, recorded


def _weight_files(src: Path) -> tuple[list[Path], dict | None]:
    """-> (the weight files of a folder, or the one file; the folder's config.json or None)."""
    config = None
    if src.is_dir():
        if (src / "config.json").exists():
            config = json.loads((src / "config.json").read_text())
        files = sorted(src.glob("*.safetensors")) or sorted(src.glob("pytorch_model*.bin")) or \
            sorted(src.glob("*.ckpt")) + sorted(src.glob("*.pt"))
        if not files:
            raise FileNotFoundError(f"{src}: no *.safetensors, pytorch_model*.bin, *.ckpt or *.pt inside")
    elif src.exists():
        files = [src]
    else:
        raise FileNotFoundError(f"checkpoint {src} does not exist")
    return files, config


def _load_state(files: list[Path]) -> tuple[dict[str, torch.Tensor], int | None]:
    """-> (every file's tensors in one dict, the first max_position_embeddings a checkpoint records or None)."""
    state: dict[str, torch.Tensor] = {}
    recorded = None
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            try:
                part = load_file(str(f))
            except SafetensorError as e:  # truncated, or not safetensors at all
                raise ValueError(f"{f} is not a safetensors file ({e}): a cut-off download? fetch it again") from None
        else:  # .bin is a plain state dict; MineWorld's .ckpt wraps it in {"state_dict": ...} (Lightning)
            part = load_weights_only(f, "checkpoint")
            recorded = recorded or recorded_positions({k: v for k, v in part.items() if k != "state_dict"})
            part = part.get("state_dict", part)
        state.update(part)
    return state, recorded


def _llama_weights(src: Path, state: dict) -> dict[str, torch.Tensor]:
    """The LLaMA's tensors of `state` (MineWorld's VQ and anything else left out), checked to be a whole one."""
    llama, skipped = {}, 0
    for key, value in state.items():
        key = key.removeprefix("transformer.")  # MineWorld's LlamaLVM wrapper
        if key.startswith(("model.", "lm_head.")) and torch.is_tensor(value):
            llama[key] = value
        else:
            skipped += 1
    if not llama:
        raise ValueError(f"{src}: no LLaMA weights (keys model.* / lm_head.*, optionally under transformer.)")
    missing = [k for k in ("model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight") if k not in llama]
    if missing:
        raise ValueError(f"{src}: LLaMA weights without {missing[0]} (found {sorted(llama)[:4]} ...): not a whole "
                         f"LlamaForCausalLM checkpoint")
    if skipped:
        log.info("left out %d tensors that are not the LLaMA (e.g. MineWorld's VQ, tokenizer.*)", skipped)
    return llama


def recorded_positions(obj, depth: int = 0) -> int | None:
    """The first `max_position_embeddings` found in nested dicts / lists (a checkpoint's hyper-parameters)."""
    if depth > 6:
        return None
    if isinstance(obj, dict):
        if isinstance(obj.get("max_position_embeddings"), int):
            return obj["max_position_embeddings"]
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return next((n for v in obj if (n := recorded_positions(v, depth + 1))), None)
    return None


def model_config(llama: dict, config: dict | None, preset: str | None,
                 heads: int | None) -> tuple[ModelConfig, int | None]:
    """(the mcar ModelConfig, max_position_embeddings or None), checked against the weights' shapes."""
    vocab, dim = llama["model.embed_tokens.weight"].shape
    n_layers = 1 + max(int(m.group(1)) for k in llama if (m := re.match(r"model\.layers\.(\d+)\.", k)))
    mlp = llama["model.layers.0.mlp.gate_proj.weight"].shape[0]
    max_pos, arch = None, dict(vocab_size=vocab, dim=dim, n_layers=n_layers, mlp_dim=mlp, rope="1d")
    if config is not None:
        arch |= _config_json_arch(config, dim)
        max_pos = config.get("max_position_embeddings")
    elif preset is not None:
        arch |= _preset_arch(preset)
        max_pos = MINEWORLD_16F_POSITIONS
    elif heads is not None:
        kv_dim = llama["model.layers.0.self_attn.k_proj.weight"].shape[0]
        arch |= dict(n_heads=heads, n_kv_heads=kv_dim // (dim // heads))
    else:
        raise ValueError("no config.json next to the weights: pass model=<conf/model name> (e.g. mineworld_700m) "
                         "or heads=<attention heads>")
    cfg = ModelConfig(**arch)
    for name, want in [("model.layers.0.self_attn.q_proj.weight", (cfg.n_heads * cfg.head_dim, dim)),
                       ("model.layers.0.self_attn.k_proj.weight", (cfg.n_kv_heads * cfg.head_dim, dim))]:
        if tuple(llama[name].shape) != want:
            raise ValueError(f"{name} has shape {tuple(llama[name].shape)}, the config asks {want} "
                             f"(n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}, head_dim={cfg.head_dim})")
    return cfg, max_pos


def _config_json_arch(config: dict, dim: int) -> dict:
    """Heads, RoPE base and norm eps from transformers' config.json, refusing what mcar's layers cannot hold."""
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("config.json: attention_bias / mlp_bias are not supported (mcar layers have no biases)")
    rope = config.get("rope_parameters") or {}  # transformers >= 5 keeps theta and type here
    scaling = config.get("rope_scaling") or ({} if rope.get("rope_type", "default") == "default" else rope)
    if scaling:
        raise ValueError(f"config.json: rope_scaling={scaling} is not supported (plain RoPE only)")
    heads = config["num_attention_heads"]
    if config.get("head_dim") not in (None, dim // heads):
        raise ValueError(f"config.json: head_dim={config['head_dim']} is not hidden_size / num_attention_heads "
                         f"= {dim // heads}, which mcar's attention assumes")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={config['hidden_act']!r}; mcar's MLP is SwiGLU (silu)")
    return dict(n_heads=heads,
                n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
                rope_base=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                norm_eps=float(config.get("rms_norm_eps", 1e-6)))


def _preset_arch(preset: str) -> dict:
    """Heads, RoPE base and norm eps of conf/model/<preset>.yaml."""
    path = CONF_DIR / "model" / f"{preset}.yaml"
    if not path.exists():
        raise FileNotFoundError(f"model={preset}: no {path}")
    given = yaml.safe_load(path.read_text())["arch"]
    return {k: v for k, v in given.items() if k in ("n_heads", "n_kv_heads", "rope_base", "norm_eps")}


def to_mcar(llama: dict, cfg: ModelConfig, tie: bool = False) -> dict[str, torch.Tensor]:
    """LLaMA names -> mcar's (wqkv = [q; k; v], w13 = [gate; up], see FUSED); q/k need no permutation: both
    rotate (x[:D/2], x[D/2:])."""
    out = {}
    for key, value in llama.items():
        m = re.match(r"model\.layers\.(\d+)\.(\w+)\.(\w+)\.weight$", key)
        if m and (m[2], m[3]) in FUSED_PART:
            fused = FUSED_PART[m[2], m[3]]
            group, parts = FUSED[fused]
            if m[3] == parts[0]:
                names = [f"model.layers.{m[1]}.{group}.{part}.weight" for part in parts]
                if absent := [n for n in names if n not in llama]:
                    raise ValueError(f"LLaMA weights without {absent[0]}: not a whole LlamaForCausalLM checkpoint")
                out[f"layers.{m[1]}.{fused}.weight"] = torch.cat([llama[n] for n in names], 0)
            continue
        if key.endswith(".bias") or "rotary_emb" in key:
            if key.endswith(".bias"):
                raise ValueError(f"{key}: mcar layers have no biases")
            continue
        for pattern, repl in RENAMES:
            key = re.sub(pattern, repl, key)
        out[key] = value
    if "output.weight" not in out:
        if not tie:
            raise ValueError("no lm_head.weight and tie_word_embeddings is false")
        out["output.weight"] = out["tok_embeddings.weight"]
    with torch.device("meta"):  # shapes only, no memory
        expected = Transformer(cfg).state_dict()
    missing, unexpected = sorted(set(expected) - set(out)), sorted(set(out) - set(expected))
    wrong = [k for k in expected if k in out and tuple(out[k].shape) != tuple(expected[k].shape)]
    if missing or unexpected or wrong:
        raise ValueError(f"converted weights do not fit the model: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}, wrong shapes {wrong[:5]}")
    return {k: v.contiguous() for k, v in out.items()}


def convert_mineworld(src: str | Path, out: str | Path, preset: str | None = None, heads: int | None = None,
                      frames: int | None = None, dtype: str = "float32", overwrite: bool = False, **layout) -> Path:
    """-> the written checkpoint path (<out>/last.ckpt). An `out` that holds checkpoints (a trained run) is refused
    unless overwrite=True."""
    held = sorted(p.name for p in Path(out).glob("*.ckpt")) if Path(out).is_dir() else []
    if held and not overwrite:
        raise FileExistsError(f"out={out} already holds checkpoints ({', '.join(held[:3])}): choose another out=, "
                              f"or pass overwrite=true to replace its last.ckpt")
    llama, config, recorded = read_weights(Path(src))
    cfg, max_pos = model_config(llama, config, preset, heads)
    if recorded and not (config and config.get("max_position_embeddings")):
        max_pos = recorded  # the checkpoint's own length (a 32-frame MineWorld), not the preset's 16 frames
    lay = Layout(**(MINEWORLD_LAYOUT | {k: int(v) for k, v in layout.items()}))
    if frames is None:
        if not max_pos:
            raise ValueError("frames=<clip frames> is needed: no max_position_embeddings in the config")
        frames = max_pos // lay.frame_len
    if max_pos and lay.n_slots(frames) > max_pos:
        raise ValueError(f"frames={frames}: {lay.n_slots(frames)} slots exceed max_position_embeddings={max_pos}")
    tie = bool(config and config.get("tie_word_embeddings"))
    weights = to_mcar(llama, cfg, tie)
    weights = {f"model.{k}": v.to(getattr(torch, dtype)) for k, v in weights.items()}
    hp = dict(arch={f: getattr(cfg, f) for f in ModelConfig.__dataclass_fields__},
              layout=dict(h=lay.h, w=lay.w, n_a=lay.n_a), clip_frames=int(frames),
              mask={"name": "causal", "backend": "auto"}, schedule=asdict(ScheduleConfig(proxy="prompt")), optim={},
              max_steps=1, model_name=preset or "mineworld")
    path = Path(out) / "last.ckpt"
    path.parent.mkdir(parents=True, exist_ok=True)
    # atomic: a killed conversion never leaves a half-written last.ckpt
    AtomicCheckpointIO().save_checkpoint({"hyper_parameters": hp, "state_dict": weights, "converted_from": str(src)},
                                         path)
    log.info("wrote %s: %s, %d layers, dim %d, %d/%d heads, vocab %d, %d frames of %d slots", path, hp["model_name"],
             cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size, frames, lay.frame_len)
    return path


def main(argv: list[str] | None = None) -> None:
    """`mcar convert format=mineworld src=<checkpoint> out=...` (conf/convert.yaml)."""
    c = compose_tool("convert", argv)
    if c.format != "mineworld":
        sys.exit(f"format={c.format!r}: mcar convert knows `mineworld` only\n\n{__doc__}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(convert_mineworld(c.src, c.out, c.model.name if "model" in c else None, c.heads, c.frames, c.dtype,
                            bool(c.overwrite),
                            **{k: c[k] for k in ("h", "w", "n_a") if c[k] is not None}))
