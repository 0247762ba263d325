"""Fine-tuning set-up: find the pre-trained checkpoint and adopt its model config."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, open_dict

from mcar.checkpoint.config import adopt_checkpoint_config, checkpoint_group_config
from mcar.checkpoint.io import load_checkpoint
from mcar.checkpoint.load import resolve_ckpt
from mcar.hydra_app import command_line_overrides, to_dict

log = logging.getLogger("mcar")


@dataclass
class Pretrained:
    """A run's last.ckpt under the checkpoint root, described by what its stored config says it is; `skip`: why it
    is never picked (unreadable, not a pre-training run, outside the root, dated in the future)."""
    path: Path
    data: str | None
    model: str | None
    arch: dict
    mtime: float
    skip: str | None = None
    step: int = 0  # its training steps (global_step)

    def line(self) -> str:
        dims = f"dim {self.arch.get('dim')}, {self.arch.get('n_layers')} layers" if self.arch else "no model config"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.mtime))
        return f"  {self.path}  step {self.step}  data={self.data} model={self.model} ({dims})  {when}" + \
            (f"  [skipped: {self.skip}]" if self.skip else "")


def pretrained_checkpoints(checkpoint_root: str | Path) -> list[Pretrained]:
    """Every <run>/last.ckpt under checkpoint_root, newest first, each read for its hyperparameters and step only
    (the weights stay memory-mapped on disk); those that cannot start a fine-tuning carry why (`skip`)."""
    root, found, now = Path(checkpoint_root).resolve(), [], time.time()
    for path in Path(checkpoint_root).glob("*/last.ckpt"):
        mtime, skip = path.lstat().st_mtime, None
        if not path.resolve().is_relative_to(root):
            found.append(Pretrained(path, None, None, {}, mtime, f"a link out of {checkpoint_root}"))
            continue
        try:
            ckpt = load_checkpoint(path)
        except Exception as e:  # noqa: BLE001  truncated, not a checkpoint, refused: named, never picked
            found.append(Pretrained(path, None, None, {}, mtime, f"unreadable ({str(e).splitlines()[0][:120]})"))
            continue
        hp = ckpt.get("hyper_parameters") or {}
        hp = hp if isinstance(hp, dict) else {}
        data = hp.get("data") if isinstance(hp.get("data"), dict) else {}
        if hp.get("stage") != "train":
            skip = f"stage={hp.get('stage')}, not a pre-training run"
        elif mtime > now + 60:
            skip = "dated in the future"
        arch = hp.get("arch") if isinstance(hp.get("arch"), dict) else {}
        step = ckpt.get("global_step", 0)
        found.append(Pretrained(path, data.get("name"), hp.get("model_name"), dict(arch), mtime, skip,
                                int(step) if isinstance(step, int) else 0))
    return sorted(found, key=lambda c: c.mtime, reverse=True)


def pick_pretrained(cfg: DictConfig) -> Path:
    """init_from's default: of the pre-training checkpoints (stage=train) under paths.checkpoint_root whose stored
    config has this run's data (data.name) and model (model.name and every model.arch dimension), the most trained
    one (most steps: a short sweep job after the main run does not take its place); of equal steps the newest.
    Said in the log with its step and the matches passed over; refused, with the candidates one per line (and why
    any is skipped), when none matches or the two best have the same steps and were written in the same second."""
    root = cfg.paths.checkpoint_root
    found = pretrained_checkpoints(root)
    if not found:
        raise FileNotFoundError(f"init_from: no pre-trained checkpoint (*/last.ckpt) under {root}; run train.py "
                                f"first or pass init_from=/path/to.ckpt")
    arch = to_dict(cfg.model.arch)
    match = [c for c in found if c.skip is None and c.data == cfg.data.name and c.model == cfg.model.name
             and all(c.arch.get(k) == v for k, v in arch.items())]
    match.sort(key=lambda c: (c.step, c.mtime), reverse=True)  # most steps, then newest
    listed = "\n".join(c.line() for c in found)
    wanted = f"data={cfg.data.name} model={cfg.model.name} (dim {arch.get('dim')}, {arch.get('n_layers')} layers)"
    if not match:
        raise FileNotFoundError(f"init_from: no pre-trained checkpoint of {wanted} under {root}; pass "
                                f"init_from=<one of these>, or the data= and model= it was trained with:\n{listed}")
    if len(match) > 1 and match[0].step == match[1].step and int(match[0].mtime) == int(match[1].mtime):
        raise ValueError(f"init_from: {match[0].path} and {match[1].path} are both the most trained (step "
                         f"{match[0].step}) and newest pre-trained checkpoint of {wanted}; pass init_from=<one of "
                         f"these>:\n{listed}")
    log.info("init_from: %s (step %d), the most trained pre-training checkpoint of %s under %s%s", match[0].path,
             match[0].step, wanted, root, "; passed over:\n" + "\n".join(c.line() for c in match[1:])
             if len(match) > 1 else "")
    others = [c for c in found if c not in match]
    if others:
        log.info("init_from: not of this data and model, or skipped: %d checkpoint(s):\n%s", len(others),
                 "\n".join(c.line() for c in others))
    return match[0].path


def prepare_finetune(cfg: DictConfig) -> str:
    """Resolve cfg.init_from and copy the checkpoint's model config and layout checks into cfg."""
    path = resolve_ckpt(cfg.init_from, "init_from") if cfg.get("init_from") else pick_pretrained(cfg)
    hp = load_checkpoint(path).get("hyper_parameters", {})
    if "arch" not in hp:
        raise ValueError(f"init_from: {path} is not an mcar training checkpoint (no model config inside)")
    adopt_checkpoint_config(cfg, hp, f"init_from={path}")
    data = cfg.data
    for field in ("h", "w", "n_a"):
        if hp["layout"][field] != data[field]:
            raise ValueError(f"init_from: {path} was trained with data.{field}={hp['layout'][field]}, "
                             f"but this run has data.{field}={data[field]}")
    if cfg.get("retoken"):
        check_retoken(hp, data, cfg.vq.path, path)
    elif hp["arch"]["vocab_size"] != data.vocab_size:
        raise ValueError(f"init_from: {path} has vocab_size={hp['arch']['vocab_size']}, but data.vocab_size="
                         f"{data.vocab_size}; to start from it on another patch VQ, add retoken=true")
    asked = [o for o in command_line_overrides() if o.split("=")[0].lstrip("+~") == "model"]
    if asked and asked[-1].split("=", 1)[1] != hp.get("model_name"):
        raise ValueError(f"{asked[-1]}: fine-tuning keeps the model of init_from ({path}: "
                         f"{hp.get('model_name', 'its own config')}); drop {asked[-1]}, or pass init_from= a "
                         f"checkpoint of that model")
    layers = grown_layers(cfg, hp, path)
    with open_dict(cfg):
        if "data" in cfg and not any(o.split("=")[0].lstrip("+~") == "data.seed" for o in command_line_overrides()):
            cfg.data.seed = cfg.seed  # the batch order follows this run's seed=, not the pre-training run's
        cfg.init_from = str(path)
        cfg.model.arch = dict(hp["arch"], vocab_size=int(data.vocab_size), n_layers=layers)
        if cfg.get("rope_base") is not None:  # the same weights, another RoPE frequency ladder
            cfg.model.arch["rope_base"] = float(cfg.rope_base)
        cfg.model.name = hp.get("model_name", cfg.model.name)
        if layers != hp["arch"]["n_layers"]:
            cfg.model.name = f"{cfg.model.name}_{layers}layers"
    log.info("fine-tuning %s (model %s)", path, cfg.model.name)
    return str(path)


def grown_layers(cfg: DictConfig, hp: dict, source) -> int:
    """The fine-tuned model's depth: init_from's, or grow_layers (more blocks, see grown_state)."""
    old, new = int(hp["arch"]["n_layers"]), cfg.get("grow_layers")
    if new is None:
        return old
    if new <= old:
        raise ValueError(f"grow_layers={new}: {source} already has {old} layers; pass more than {old}, or drop "
                         f"grow_layers")
    return int(new)


def source_vq_path(hp: dict, source) -> str:
    """The VQ a checkpoint was trained with, as this install's path (its vq group, assets relocated)."""
    if not isinstance(hp.get("vq"), dict) or not hp["vq"].get("path"):
        raise ValueError(f"retoken=true: {source} does not record its VQ (hyper_parameters.vq.path); retoken needs "
                         f"the codes it was trained on")
    return str(checkpoint_group_config("vq", hp["vq"], source)["path"])


def check_retoken(hp: dict, data, vq_path: str, source) -> None:
    """retoken=true: init_from's image codes map onto this run's (both patch VQs), its action ids are this run's."""
    from mcar.tokenizer.vq_model import vq_id  # diffusers: imported by retoken only (GPU images lack it)

    old = hp.get("data") or {}
    if old.get("action_vocab_size") != data.action_vocab_size:
        raise ValueError(f"retoken=true: {source} has action_vocab_size={old.get('action_vocab_size')}, this run "
                         f"{data.action_vocab_size}; retoken maps image codes only, the actions must be the same")
    if vq_id(source_vq_path(hp, source)) == vq_id(vq_path):  # by weights: the same VQ may sit in two installs
        raise ValueError(f"retoken=true: this run's VQ is {source}'s own ({vq_path}), which it keeps unless vq= "
                         f"is given; pass the new VQ and its data (e.g. data=crafter_tiles_all_world vq=tiles_all), "
                         f"or drop retoken=true")


def retoken_state(state: dict, codes: torch.Tensor, exact: torch.Tensor, old_codebook: int, new_codebook: int
                  ) -> dict:
    """A model state dict on `old_codebook` image codes -> one on `new_codebook` (code_map's codes, exact): new code
    i reads as old code codes[i] (input embedding); its output row is old code codes[i]'s where it has exactly those
    pixels, else the mean of the old image codes' rows (a new texture then starts at an average logit instead of
    tying with its nearest code: Hewitt 2021, as transformers' resize_token_embeddings). The action ids after the
    codebook keep their rows."""
    if len(codes) != new_codebook or len(exact) != new_codebook:
        raise ValueError(f"retoken: {len(codes)} mapped codes for a codebook of {new_codebook}")
    out = dict(state)
    emb, head = state["model.tok_embeddings.weight"], state["model.output.weight"]
    out["model.tok_embeddings.weight"] = torch.cat([emb[codes], emb[old_codebook:]]).contiguous()
    image = torch.where(exact[:, None], head[codes], head[:old_codebook].mean(0, keepdim=True))
    out["model.output.weight"] = torch.cat([image.to(head.dtype), head[old_codebook:]]).contiguous()
    return out


def grown_state(state: dict, old_layers: int, new_layers: int) -> dict:
    """A model state dict of `old_layers` blocks -> one of `new_layers` computing the same function (LLaMA Pro's
    block expansion, Wu et al. 2024): the new blocks are spread evenly, each a copy of the block before it with its
    residual outputs (attention.wo, feed_forward.w2) zeroed, so it adds nothing until training moves them."""
    prefix = "model.layers."
    extra = new_layers - old_layers
    order = []  # (the old block each new position copies, whether it is a new block)
    for i in range(old_layers):
        order += [(i, False)] + [(i, True)] * ((i + 1) * extra // old_layers - i * extra // old_layers)
    out = {k: v for k, v in state.items() if not k.startswith(prefix)}
    for pos, (src, new) in enumerate(order):
        for key, value in state.items():
            if key.startswith(f"{prefix}{src}."):
                name = key[len(f"{prefix}{src}."):]
                zero = new and name in ("attention.wo.weight", "feed_forward.w2.weight")
                out[f"{prefix}{pos}.{name}"] = torch.zeros_like(value) if zero else value.clone()
    return out


def initial_state(cfg: DictConfig, init_from: str) -> dict:
    """The weights a run starts from: init_from's, its image codes mapped onto this run's VQ when retoken=true."""
    ckpt = load_checkpoint(init_from)
    state = ckpt["state_dict"]
    if cfg.get("grow_layers"):
        state = grown_state(state, int(ckpt["hyper_parameters"]["arch"]["n_layers"]), int(cfg.grow_layers))
    if not cfg.get("retoken"):
        return state
    from mcar.tokenizer.patch_vq import code_map  # diffusers: imported by retoken only (GPU images lack it)
    from mcar.tokenizer.vq_model import load_vq

    hp = ckpt["hyper_parameters"]
    src, dst = load_vq(source_vq_path(hp, init_from)), load_vq(cfg.vq.path)
    try:
        codes, exact = code_map(src, dst)
    except ValueError as e:
        raise ValueError(f"retoken=true ({init_from} -> vq.path={cfg.vq.path}): {e}") from None
    log.info("retoken: %d of %d codes of %s start from the code of %s with their pixels; %d (new textures, pads) "
             "read as their nearest code and start at the mean output row", int(exact.sum()), len(codes),
             cfg.vq.path, hp["vq"]["path"], int((~exact).sum()))
    return retoken_state(state, codes, exact, int(hp["data"]["codebook_size"]),
                         int(cfg.data.codebook_size))
