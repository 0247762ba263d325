"""Mask factories on an accelerator: a training step copies nothing from the host (issue 1/5 item 4).

A copy from pageable host memory to a GPU waits for the GPU (a host sync), so the factories copy their constant
tensors (coordinates, gather indices, loss masks) to a device once and reuse them. Checked on the meta device,
which stands in for a GPU: a copy from CPU to meta is a real cross-device copy, seen by a dispatch mode.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mcar.core.layout import Layout
from mcar.core.masks import CausalMask, DiagDMask

LAYOUT, FRAMES = Layout(3, 4, 2), 3
COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten._copy_from.default,
          torch.ops.aten._copy_from_and_resize.default}

FACTORIES = {
    "causal": lambda: CausalMask(LAYOUT, FRAMES),
    "causal_action_loss": lambda: CausalMask(LAYOUT, FRAMES, action_loss=True),
    "diagd": lambda: DiagDMask(LAYOUT, FRAMES, k=2),
    "diagd_plain_rows": lambda: DiagDMask(LAYOUT, FRAMES, k=2, proxy_slots=False),
    "diagd_generated_only": lambda: DiagDMask(LAYOUT, FRAMES, k=2, generated_only=True),
}


class HostToDevice(TorchDispatchMode):
    """Records every copy of a CPU tensor to another device."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = tree_leaves((args, kwargs))
        from_host = any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in leaves)
        to_device = any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tree_leaves(out))
        if func in COPIES and from_host and to_device:
            self.copies.append(func)
        return out


def clip():
    return torch.randint(0, 32, (2, LAYOUT.n_slots(FRAMES)))


@pytest.mark.parametrize("name", FACTORIES)
def test_a_step_after_the_first_makes_no_host_to_device_copy(name):
    factory = FACTORIES[name]()
    on_device = clip().to("meta")
    first = factory(on_device)
    with HostToDevice() as seen:
        second = factory(on_device)
    assert seen.copies == [], f"{name}: {seen.copies}"
    assert second.coords is first.coords  # the cached device copy, not a new one
    assert (second.tokens.shape, second.targets.shape, second.coords.shape) == (
        first.tokens.shape, first.targets.shape, first.coords.shape)


@pytest.mark.parametrize("name", FACTORIES)
def test_cached_inputs_give_a_fresh_factorys_batch(name):
    factory, x = FACTORIES[name](), clip()
    factory(clip())  # fills the cache
    cached, fresh = factory(x), FACTORIES[name]()(x)
    for field in ("tokens", "coords", "targets"):
        assert torch.equal(getattr(cached, field), getattr(fresh, field)), field
    assert (cached.mask is None and fresh.mask is None) or torch.equal(cached.mask, fresh.mask)


def test_next_token_targets_keep_image_slots_only():
    x = clip()
    batch = CausalMask(LAYOUT, FRAMES)(x)
    image = LAYOUT.is_image(FRAMES)
    for p in range(x.shape[1]):
        want = x[:, p + 1] if p + 1 < x.shape[1] and image[p + 1] else torch.full((2,), -100)
        assert torch.equal(batch.targets[:, p], want), p
