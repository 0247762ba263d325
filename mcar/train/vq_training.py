"""Train or fine-tune the diffusers VQModel image tokenizer (Lightning), on mp4 episodes split by episode.

    mcar vq_train                                  # small VQ on Crafter (generates episodes if absent)
    mcar vq_train vq=amused vq.path=/path/to/amused-vqvae episodes=/path/to/vpt  # fine-tune aMUSEd
    mcar vq_train ckpt_path=last                   # resume out/lightning/last.ckpt

Loss: MSE reconstruction + codebook + 0.25 commitment. Against codebook collapse (a naive run used 15 of 1,024
codes and drew flat green): l2-normalised 8-dim codes looked up by cosine (L2Quantizer), codes initialised by
spherical k-means on encoder outputs, and dead-code restarts (codes unused for ~100 steps are moved onto random
current encoder outputs). Held-out whole frames (other episodes) are scored every `val_every` steps: PSNR, SSIM,
codebook usage; a PNG of originals above reconstructions is written; `out/best` (highest PSNR) and `out/last`
are plain diffusers folders (`VQModel.from_pretrained`).
"""
from __future__ import annotations

import functools
import time
from pathlib import Path

import hydra
import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from mcar.atomic import write_atomic, write_json, written_atomically
from mcar.checkpoint.io import AtomicCheckpointIO, load_checkpoint
from mcar.core.devices import set_threads
from mcar.core.lr_schedule import warmup_linear_decay
from mcar.data.common import StepsFrom
from mcar.data.episodes import episode_files
from mcar.tokenizer import quality
from mcar.tokenizer.video import read_mp4
from mcar.tokenizer.vq_model import (
    VQ_DONE,
    L2Quantizer,
    build_vq,
    check_frame_size,
    decode_latents,
    frame_size,
    load_vq,
    save_vq,
    to_input,
    to_uint8,
    use_l2_quantizer,
    vq_finished,
)


# ---------------------------------------------------------------------------------------------------- data
def load_frames(files: list[Path], stride: int, max_per_episode: int | None = None, desc: str = "frames",
                size: tuple[int, int] | None = None) -> torch.Tensor:
    """(N, H, W, 3) uint8: every `stride`-th frame of each file, resized to size = (H, W) when given (None: as
    stored); damaged files are skipped with a warning."""
    out = []
    for f in tqdm(files, desc=desc, unit="ep"):
        frames, err = read_mp4(f, size)
        if err:
            print(f"warning: {f}: {err} (kept {len(frames)} decoded frames)")
        frames = frames[::stride][:max_per_episode]
        out.append(torch.from_numpy(frames))
    if not out or sum(len(x) for x in out) == 0:
        raise ValueError(f"no frames found in {files[:1] or 'an empty episode list'}")
    return torch.cat(out)


class CropBatches(Dataset):
    """Item s: the (B, 3, ch, cw) batch of training step s, random frames and grid-aligned crops in [-1, 1]."""

    def __init__(self, frames: torch.Tensor, batch_size: int, crop: tuple[int, int], align: int, seed: int):
        self.frames, self.batch_size, self.crop, self.align, self.seed = frames, batch_size, crop, align, seed

    def __len__(self):
        return 2**62

    def __getitem__(self, step: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, step])
        N, H, W, _ = self.frames.shape
        ch, cw = self.crop
        out = []
        for i in rng.integers(0, N, self.batch_size):
            # offsets on the 16-pixel token grid: crops look like whole-frame token cells
            y = int(rng.integers(0, (H - ch) // self.align + 1)) * self.align
            x = int(rng.integers(0, (W - cw) // self.align + 1)) * self.align
            out.append(self.frames[i, y:y + ch, x:x + cw])
        return to_input(torch.stack(out))


# --------------------------------------------------------------------------------------------------- model
class VQLit(L.LightningModule):
    def __init__(self, cfg: DictConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.init_from:
            self.vq = use_l2_quantizer(load_vq(cfg.init_from).train()) if cfg.l2_codes else load_vq(cfg.init_from)
        else:
            self.vq = build_vq(OmegaConf.to_container(cfg.vq.arch), l2_codes=cfg.l2_codes)
        K = self.vq.quantize.n_e
        self.register_buffer("usage", torch.full((K,), 1.0))  # EMA of per-step hits per code
        self.register_buffer("restarts", torch.zeros((), dtype=torch.long))
        self.best_psnr, self.t0 = previous_best(Path(cfg.out)) if cfg.get("ckpt_path") else -1.0, None
        self.val_ids, self.val_psnr, self.val_ssim, self.val_shown = [], [], [], None

    def forward(self, x):  # -> reconstruction, codebook loss, ids
        z_q, q_loss, (_, _, ids) = self.vq.quantize(self.vq.encode(x).latents)
        return decode_latents(self.vq, z_q), q_loss, ids

    def configure_optimizers(self):
        c = self.cfg
        opt = torch.optim.Adam(self.vq.parameters(), lr=c.lr, betas=tuple(c.betas))

        factor = functools.partial(warmup_linear_decay, warmup_steps=c.warmup_steps, total=c.steps,
                                   decay_frac=c.decay_frac, min_lr_ratio=c.min_lr_ratio)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---- anti-collapse
    @torch.no_grad()
    def kmeans_init(self, batches: list[torch.Tensor], iters: int = 10):
        """Spherical k-means on the encoder's outputs -> the initial codebook."""
        q = self.vq.quantize
        z = torch.cat([F.normalize(self.vq.encode(x).latents.permute(0, 2, 3, 1).reshape(-1, q.vq_embed_dim), dim=-1)
                       for x in batches])  # (n, D)
        K = q.n_e
        g = torch.Generator().manual_seed(self.cfg.seed)
        centers = z[torch.randint(0, len(z), (K,), generator=g)] + 1e-3 * torch.randn(K, z.shape[1], generator=g)
        for _ in range(iters):
            centers = F.normalize(centers, dim=-1)
            assign = (z @ centers.t()).argmax(1)
            sums = torch.zeros_like(centers).index_add_(0, assign, z)
            counts = torch.bincount(assign, minlength=K)
            empty = counts == 0  # re-seed empty clusters on random points
            sums[empty] = z[torch.randint(0, len(z), (int(empty.sum()),), generator=g)]
            centers = sums
        q.embedding.weight.data.copy_(F.normalize(centers, dim=-1))
        print(f"k-means init: {K} codes from {len(z)} encoder outputs")

    @torch.no_grad()
    def restart_dead_codes(self):
        q = self.vq.quantize
        dead = (self.usage < self.cfg.dead_threshold).nonzero().flatten()
        if len(dead) == 0 or not hasattr(q, "last_z"):
            return
        z = q.last_z
        pick = torch.randint(0, len(z), (len(dead),), device=z.device)
        q.embedding.weight.data[dead] = F.normalize(z[pick] + 0.01 * torch.randn_like(z[pick]), dim=-1)
        self.usage[dead] = self.cfg.dead_threshold * 10  # a grace period before it can be restarted again
        self.restarts += len(dead)

    def on_train_start(self):
        if self.global_step == 0 and self.cfg.kmeans_init and isinstance(self.vq.quantize, L2Quantizer):
            ds = self.trainer.train_dataloader.dataset  # steps far beyond training: unseen crops
            self.kmeans_init([ds[2**40 + i].to(self.device) for i in range(self.cfg.kmeans_batches)])
        self.t0 = time.time()

    def training_step(self, x, step):
        rec, q_loss, ids = self(x)
        mse = F.mse_loss(rec, x)
        loss = mse + q_loss
        with torch.no_grad():
            hits = torch.bincount(ids, minlength=len(self.usage)).float()
            self.usage.mul_(self.cfg.usage_decay).add_(hits, alpha=1 - self.cfg.usage_decay)
        if self.cfg.restart_every and self.global_step % self.cfg.restart_every == 0 and self.global_step > 0:
            self.restart_dead_codes()
        psnr = quality.psnr(rec.detach(), x, data_range=2.0, min_mse=1e-10).item()  # x in [-1, 1]
        self.log_dict({"train/loss": loss, "train/mse": mse, "train/q_loss": q_loss, "train/psnr": psnr,
                       "train/live_codes": (self.usage > self.cfg.dead_threshold).float().sum(),
                       "train/restarts": self.restarts.float()}, prog_bar=True)
        if self.global_step % self.cfg.print_every == 0:
            now = time.time()
            rate, self.t0 = (now - self.t0) / self.cfg.print_every, now
            print(f"step {self.global_step} loss {loss.item():.4f} psnr {psnr:.2f} live "
                  f"{int((self.usage > self.cfg.dead_threshold).sum())} restarts {int(self.restarts)} "
                  f"lr {self.optimizers().param_groups[0]['lr']:.2e} {rate:.2f}s/step", flush=True)
        return loss

    # ---- held-out whole frames
    def validation_step(self, x, i):
        x = x.to(self.device)
        rec, _, ids = self(x)
        psnr, ssim = quality.frame_scores(x, rec)
        self.val_psnr.append(psnr)
        self.val_ssim.append(ssim)
        self.val_ids.append(ids)
        if i == 0:
            self.val_shown = (x[:4].cpu(), rec[:4].cpu())

    def on_validation_epoch_end(self):
        if not self.val_psnr:
            return
        psnr, ssim = torch.cat(self.val_psnr).mean().item(), torch.cat(self.val_ssim).mean().item()
        usage = torch.cat(self.val_ids).unique().numel() / self.vq.quantize.n_e
        self.val_ids, self.val_psnr, self.val_ssim = [], [], []
        self.log_dict({"val/psnr": psnr, "val/ssim": ssim, "val/usage": usage})
        print(f"val step {self.global_step}: psnr {psnr:.2f} dB ssim {ssim:.4f} usage {usage:.1%}", flush=True)
        if self.trainer.sanity_checking:
            return
        out = Path(self.cfg.out)
        save_grid(out / "recon" / f"step{self.global_step:06d}.png", *self.val_shown)
        save_vq(self.vq, out / "last")
        if psnr > self.best_psnr:
            self.best_psnr = psnr
            save_vq(self.vq, out / "best")
            write_atomic(out / "best" / "metrics.txt",
                f"step {self.global_step}\npsnr {psnr:.3f}\nssim {ssim:.4f}\nusage {usage:.4f}\n")


def previous_best(out: Path) -> float:
    """The PSNR of out/best (a resumed run must beat it before overwriting it)."""
    f = out / "best" / "metrics.txt"
    if not f.exists():
        return -1.0
    return float(dict(line.split(" ", 1) for line in f.read_text().splitlines())["psnr"])


def save_grid(path: Path, originals: torch.Tensor, recons: torch.Tensor) -> None:
    """PNG: originals (top row) above reconstructions (bottom row)."""
    import imageio.v3 as iio

    top, bottom = to_uint8(originals), to_uint8(recons)  # (n, H, W, 3)
    grid = torch.cat([torch.cat(list(top), 1), torch.cat(list(bottom), 1)], 0)
    with written_atomically(path, keep_suffix=True) as tmp:
        iio.imwrite(tmp, grid.numpy())


# ---------------------------------------------------------------------------------------------------- main
def make_data(cfg: DictConfig):
    folder = Path(cfg.episodes)
    size = check_frame_size(cfg.vq.arch, cfg.frame_size, "frame_size")
    files = episode_files(folder)
    if not files and cfg.generate.episodes:  # the configured simulator's episodes (conf/vq_train.yaml `generate`)
        view = cfg.generate.get("view")
        hydra.utils.instantiate(cfg.generate, folder, size=size, view=tuple(view) if view else None)
        files = episode_files(folder)
    if len(files) <= cfg.val_episodes:
        raise ValueError(f"{folder}: {len(files)} episodes, need more than val_episodes={cfg.val_episodes}")
    train_files, val_files = files[:-cfg.val_episodes], files[-cfg.val_episodes:]  # split by episode
    train = load_frames(train_files, cfg.frame_stride, desc="train frames", size=size)
    val = load_frames(val_files, cfg.val_stride, cfg.val_per_episode, desc="held-out frames", size=size)
    print(f"{len(train_files)} train episodes ({len(train)} frames), {len(val_files)} held-out ({len(val)} frames)")
    return train, val


def train(cfg: DictConfig) -> VQLit:
    set_threads(cfg.threads)
    L.seed_everything(cfg.seed)
    train_frames, val_frames = make_data(cfg)
    lit = VQLit(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / VQ_DONE).unlink(missing_ok=True)  # until this run finishes, the VQ here is not one to tokenise with
    write_atomic(out / "config.yaml", OmegaConf.to_yaml(cfg))
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "lightning", every_n_train_steps=cfg.ckpt_every,
                                               save_last=True, save_top_k=0)
    trainer = L.Trainer(max_steps=cfg.steps, accelerator=cfg.accelerator, devices=1, logger=
                        L.pytorch.loggers.CSVLogger(out, name="logs"), callbacks=[ckpt],
                        val_check_interval=cfg.val_every, check_val_every_n_epoch=None,
                        num_sanity_val_steps=0, gradient_clip_val=cfg.grad_clip, log_every_n_steps=10,
                        enable_progress_bar=cfg.progress_bar, enable_model_summary=False,
                        plugins=[AtomicCheckpointIO()])  # ckpt_path= is read as weights only, saves are atomic
    crops = CropBatches(train_frames, cfg.batch_size, tuple(cfg.crop), cfg.crop_align, cfg.seed)
    start = 0
    ckpt_path = cfg.ckpt_path
    if ckpt_path == "last":
        ckpt_path = out / "lightning" / "last.ckpt"
        start = load_checkpoint(ckpt_path)["global_step"]
    loader = DataLoader(crops, batch_size=None, sampler=StepsFrom(start))
    val_loader = DataLoader([to_input(b) for b in val_frames.split(cfg.val_batch)], batch_size=None)
    trainer.fit(lit, loader, val_loader, ckpt_path=str(ckpt_path) if ckpt_path else None)
    if trainer.global_step >= cfg.steps:
        write_json(out / VQ_DONE, {"steps": trainer.global_step})
    return lit



def train_for_data(root: str | Path, overrides: list[str], grid: tuple[int, int]) -> VQLit:
    """The VQ a data module trains (data.vq_train=true): conf/vq_train.yaml + `overrides`, on Crafter episodes
    under root/vq_episodes, into root/vq; frames are the data's token grid (h, w) times the VQ's downsampling."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    root = Path(root)
    args = [f"paths.data_dir={root.parent}", f"paths.checkpoint_root={root}", f"episodes={root / 'vq_episodes'}",
            f"out={root / 'vq'}", *overrides]
    if (root / "vq" / "lightning" / "last.ckpt").is_file() and not vq_finished(root / "vq"):
        args.append("ckpt_path=last")  # a training that was cut off goes on from its last checkpoint
    if GlobalHydra.instance().is_initialized():  # inside a Hydra job (mcar train): its search path holds conf/
        cfg = compose("vq_train", overrides=args)
    else:
        with initialize_config_module("mcar.conf", version_base="1.3"):
            cfg = compose("vq_train", overrides=args)
    cfg.frame_size = list(frame_size(cfg.vq.arch, *grid, what="data.h, data.w"))
    threads = torch.get_num_threads()
    try:
        return train(cfg)
    finally:
        set_threads(threads)  # vq_train's thread count is for its own background runs
