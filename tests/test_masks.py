"""Mask factories on an accelerator: a training step copies nothing from the host.

A copy from pageable host memory to a GPU waits for the GPU (a host sync), so the factories copy their constant
tensors (coordinates, gather indices, loss masks) to a device once and reuse them. Checked on the meta device,
which stands in for a GPU: a copy from CPU to meta is a real cross-device copy, seen by a dispatch mode.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mcar.core.layout import Layout
from mcar.core.masks import CausalMask, DiagDMask, attention_path
from mcar.core.visibility import SlotTable

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


# ------------------------------------------------------------------------------- attention paths
@pytest.mark.parametrize("device, backend, causal, diagd", [
    ("cpu", "auto", "is_causal", "dense"), ("cuda", "auto", "is_causal", "flex"),
    ("cuda", "sdpa", "is_causal", "dense"),
    ("cuda", "flex", "flex", "flex"), ("cpu", "flex", "flex", "flex"),
])
def test_each_mask_takes_its_attention_path(device, backend, causal, diagd):
    """The plain causal mask reaches SDPA's is_causal (flash / cuDNN on a GPU) unless flex is named; DiagD takes
    flex on CUDA and a dense mask elsewhere."""
    assert attention_path(backend, torch.device(device), plain_causal=True) == causal
    assert attention_path(backend, torch.device(device), plain_causal=False) == diagd


def test_causal_batches_carry_no_mask_and_diagd_a_dense_one_on_cpu():
    clip = torch.randint(0, 30, (2, LAYOUT.n_slots(FRAMES)))
    assert CausalMask(LAYOUT, FRAMES)(clip).mask is None
    assert CausalMask(LAYOUT, FRAMES, backend="flex")(clip).mask is not None
    assert DiagDMask(LAYOUT, FRAMES, k=2)(clip).mask.dtype == torch.bool


def test_flex_gets_the_kernel_options_on_cuda_only(monkeypatch):
    """Flex's H100 forward spilled with its default 4 warps / 3 stages (BENCHMARKS.md, GPU kernels)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import mcar.core.model as model_module

    seen = []
    monkeypatch.setattr(model_module, "_wants_compiled_flex", lambda q: False)
    monkeypatch.setattr(model_module, "flex_attention", lambda *a, **kw: seen.append(kw.get("kernel_options")))
    with FakeTensorMode():
        for device in ("cuda", "cpu"):
            q = torch.empty(1, 2, 8, 4, device=device)
            model_module._flex(q, q, q, None)
    assert seen == [model_module.FLEX_KERNEL_OPTIONS, None]
    assert model_module.FLEX_KERNEL_OPTIONS == {"num_warps": 8, "num_stages": 2}
    # a run's flex_kernel_options (the GPU check's diagd_tma variant) go over the defaults, and back with null
    try:
        model_module.set_flex_kernel_options({"USE_TMA": True})
        with FakeTensorMode():
            model_module._flex(torch.empty(1, 2, 8, 4, device="cuda"), *[torch.empty(1, 2, 8, 4, device="cuda")] * 2,
                               None)
        assert seen[-1] == {"num_warps": 8, "num_stages": 2, "USE_TMA": True}
    finally:
        model_module.set_flex_kernel_options(None)
    assert model_module._flex_options == model_module.FLEX_KERNEL_OPTIONS


def rule_as_written(feed_pass, pos, is_proxy, full):
    """Docs/diagd.md section 5, element by element: the oracle of the packed mask_mod."""
    n = len(pos)
    out = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for kv in range(n):
            fq, fk, pq, pk = int(feed_pass[q]), int(feed_pass[kv]), int(pos[q]), int(pos[kv])
            visible = fk < fq or (fk == fq and pk <= pq)
            if not full:
                visible = visible and pk <= pq
            out[q, kv] = visible and (not bool(is_proxy[kv]) or q == kv)
    return out


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_packed_mask_mod_is_the_rule_as_written(data):
    n = data.draw(st.integers(1, 24))
    feed = data.draw(st.lists(st.integers(-2, 6), min_size=n, max_size=n))
    pos = data.draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    proxy = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    full = data.draw(st.booleans())
    table = SlotTable(torch.tensor(feed), torch.tensor(pos), torch.tensor(proxy), full)
    assert torch.equal(table.dense(), rule_as_written(feed, pos, proxy, full))
