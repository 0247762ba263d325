"""Quality numbers shared by the tokenizer tools, training and evaluation: the one home of the PSNR formula (token
agreement lives in mcar.core.agreement)."""
from __future__ import annotations

import torch


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float, dim: int | tuple[int, ...] | None = None,
         min_mse: float = 0.0) -> torch.Tensor:
    """PSNR in dB, 10 log10(data_range^2 / MSE), the mean squared error over `dim` (None: every element).

    +inf where a and b are identical, unless `min_mse` > 0 floors the MSE (a finite value to log or average).
    Computed in the inputs' float dtype, at least float32 (uint8 frames: float32; pass float64 for float64)."""
    if a.shape != b.shape:
        raise ValueError(f"psnr of tensors of different shapes {tuple(a.shape)} and {tuple(b.shape)}")
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    mse = (a.to(dtype) - b.to(dtype)).pow(2)
    mse = mse.mean() if dim is None else mse.mean(dim)
    if min_mse > 0:
        mse = mse.clamp_min(min_mse)
    return psnr_from_mse(mse, data_range)


def psnr_from_mse(mse: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """10 log10(data_range^2 / MSE): +inf where the MSE is 0."""
    return 10 * torch.log10(data_range**2 / mse)


def frame_scores(x: torch.Tensor, rec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) PSNR in dB and (B,) SSIM of whole frames, VQ images in [-1, 1] compared on [0, 1] (VQ training's
    validation and `mcar vq_eval`)."""
    from torchmetrics.functional.image import structural_similarity_index_measure as ssim

    a, b = (x + 1) / 2, (rec.clamp(-1, 1) + 1) / 2
    scores = psnr(a, b, data_range=1.0, dim=tuple(range(1, a.dim())), min_mse=1e-10)  # finite: a mean
    return scores, ssim(b, a, data_range=1.0, reduction="none")
