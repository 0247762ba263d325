"""Loading a trained world model for sampling: the checkpoint file, the sampling dtype, a plain Transformer built
from the checkpoint's arch and weights (no LightningModule: gpt-fast's way), and the check that the data config
fits it."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from mcar.checkpoint.io import check_state_shapes, load_checkpoint
from mcar.core.layout import Layout
from mcar.core.model import ModelConfig, Transformer
from mcar.core.precision import compute_dtype

log = logging.getLogger("mcar")


def resolve_ckpt(ckpt: str | None, key: str = "ckpt") -> Path:
    """ckpt=<file.ckpt> or ckpt=<run dir holding last.ckpt> -> the file (`key`: the key that gave it, init_from
    takes the same); clear errors otherwise."""
    if not ckpt:
        raise ValueError(f"{key} is required: {key}=checkpoints/<run_name>/last.ckpt (or the run's folder)")
    p = Path(ckpt)
    if p.is_dir():
        p = p / "last.ckpt"
    if not p.is_file():
        raise FileNotFoundError(f"{key}: checkpoint not found: {p}")
    return p


SAMPLING_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def sampling_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """dtype=auto|float32|bfloat16 (None: auto) -> the weights' and KV cache's dtype for sampling on `device`.
    auto: bfloat16 on CUDA (half the bytes a memory-bound pass reads), float32 elsewhere (CPUs lack fast bf16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return compute_dtype(device)
    if dtype not in SAMPLING_DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid; choose auto, {', '.join(SAMPLING_DTYPES)}")
    return SAMPLING_DTYPES[dtype]


@dataclass
class SamplingModel:
    """What a sampling job needs of a checkpoint: the model and the clip layout it was trained on."""

    model: Transformer
    layout: Layout


def load_model(ckpt: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None):
    """A checkpoint of train.py / finetune.py -> (SamplingModel in eval mode, its hyper-parameters).

    Parameters are cast to `dtype` (see `sampling_dtype`; default bfloat16 on CUDA, float32 on CPU), buffers are
    not: RoPE's frequencies stay float32, as in mixed-precision training. The samplers' KV cache follows the
    weights' dtype."""
    path = resolve_ckpt(None if ckpt is None else str(ckpt))
    state = load_checkpoint(path)
    hp = dict(state.get("hyper_parameters") or {})
    if "arch" not in hp or "layout" not in hp:
        raise ValueError(f"{path} has no mcar hyper_parameters (arch, layout): not a train.py checkpoint")
    check_arch_fits_weights(hp["arch"], state["state_dict"], path)
    model = transformer_of(hp["arch"], state["state_dict"]).to(device)
    dtype = sampling_dtype(dtype, device)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return SamplingModel(model, Layout(**hp["layout"])), hp


def transformer_of(arch: dict, state_dict: dict) -> Transformer:
    """A checkpoint's arch and its Lightning state dict (the model's weights under `model.`) -> the plain
    Transformer, in eval mode on the CPU."""
    model = Transformer(ModelConfig(**arch))
    model.load_state_dict({k[len("model."):]: v for k, v in state_dict.items() if k.startswith("model.")})
    return model.eval()


def check_arch_fits_weights(arch: dict, state_dict: dict, path: Path) -> None:
    """A checkpoint's arch against its weights' shapes on the meta device, before anything is allocated (an edited
    arch of a 1 kB file asked for 51 GB and died in torch)."""
    try:
        cfg = ModelConfig(**arch)
    except TypeError as e:
        raise ValueError(f"{path}: hyper_parameters.arch is not a model config ({e})") from None
    with torch.device("meta"):
        skeleton = torch.nn.Module()
        skeleton.model = Transformer(cfg)
    check_state_shapes(skeleton, {k: v for k, v in state_dict.items() if k.startswith("model.")}, str(path))


def check_data_fits(layout: Layout, hp: dict, data: DictConfig) -> None:
    """The data config fits the loaded model: its `layout` (the grid and actions it samples) and its vocabulary."""
    own = layout
    if (own.h, own.w, own.n_a) != (data.h, data.w, data.n_a) or hp["arch"]["vocab_size"] < data.vocab_size:
        raise ValueError(f"data={data.name} (h, w, n_a, vocab) = ({data.h}, {data.w}, {data.n_a}, {data.vocab_size}) "
                         f"does not fit the checkpoint's ({own.h}, {own.w}, {own.n_a}, {hp['arch']['vocab_size']}): "
                         f"pass the data config the model was trained on (data=..., data.h=...)")


def warn_past_trained_length(frames: int, hp: dict) -> None:
    """Sampling more frames than the model trained on reaches RoPE positions it never saw: allowed, said once."""
    trained = int(hp.get("clip_frames", frames))
    if frames > trained:
        log.warning("frames=%d runs past the %d frames this model was trained on: positions it never saw, expect "
                    "the clip to degrade after frame %d", frames, trained, trained)
