"""Cached passes of a few rows on a float32 CPU run their linears on oneDNN-packed weights (mcar.core.model.linear):
the same logits as F.linear to float32 rounding, the same sampled tokens, a packed copy that follows every change
of the weights, and the plain path wherever packing does not apply (1-3 rows, autograd, float64, the one-pass
forward)."""
import pytest
import torch

import mcar.core.model as model_mod
from mcar.core.layout import Layout
from mcar.core.model import ModelConfig, Transformer, packs_rows
from mcar.core.sampler import ScheduleSampler

from .test_parity import clip_for

V, T = 32, 4
LAYOUT = Layout(3, 4, 2)

pytestmark = pytest.mark.skipif(not model_mod._packing_ok[0], reason="this torch has no oneDNN weight packing")


def tiny(seed: int = 0, dtype=torch.float32) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=64, init_std=0.2)
    return Transformer(cfg).to(dtype).eval()


def packed(m: Transformer) -> bool:
    return model_mod._packed.get(m.output.weight) is not None


def one_pass(m: Transformer, rows: int, grad: bool = False) -> torch.Tensor:
    """A cached pass of `rows` inputs (batch 1) seeing nothing cached: its logits."""
    m.setup_cache(1, 16)
    pos = torch.arange(rows)
    mask = torch.ones(rows, rows, dtype=torch.bool).tril()
    with torch.set_grad_enabled(grad):
        return m(torch.arange(rows)[None] % V, LAYOUT.coords(2)[:rows], mask, pos)


def test_a_packed_pass_equals_the_plain_one(monkeypatch):
    m = tiny()
    got = one_pass(m, 7)
    assert packed(m)
    monkeypatch.setattr(model_mod, "PACKED_ROWS", range(0))
    torch.testing.assert_close(got, one_pass(m, 7), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["diagd", "ntp"])
def test_sampling_on_packed_weights_gives_the_same_tokens(name, monkeypatch):
    """generate (batch 2: every DiagD pass of 2+ rows is packed) and teacher_forced, packing on and off."""
    m, clip = tiny(), clip_for(LAYOUT)
    make = ScheduleSampler.ntp if name == "ntp" else ScheduleSampler

    def run():
        s = make(LAYOUT, T, 1, seed=2, **({} if name == "ntp" else dict(k=2)))
        return s.generate(m, clip)[0], s.teacher_forced(m, clip).logits

    tokens, logits = run()
    assert packed(m) or name == "ntp"  # DiagD's passes of 2+ inputs a stream, 4+ rows in all
    monkeypatch.setattr(model_mod, "PACKED_ROWS", range(0))
    plain_tokens, plain_logits = run()
    assert torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(logits, plain_logits, rtol=1e-5, atol=1e-5)


def test_the_packed_copy_follows_the_weights(monkeypatch):
    """An in-place write (an optimizer step, fused or not), load_state_dict, a new tensor as .data: the next packed
    pass uses the new weights."""
    m, other = tiny(0), tiny(1)

    def check():
        got = one_pass(m, 6)
        with monkeypatch.context() as mp:
            mp.setattr(model_mod, "PACKED_ROWS", range(0))
            torch.testing.assert_close(got, one_pass(m, 6), rtol=1e-5, atol=1e-5)
        return got

    first = check()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    one_pass(m, 6, grad=True).square().mean().backward()
    opt.step()
    stepped = check()
    assert not torch.allclose(first, stepped)
    fused = torch.optim.AdamW(m.parameters(), lr=0.05, fused=True)  # training's default: bumps no version counter
    one_pass(m, 6, grad=True).square().mean().backward()
    fused.step()
    assert not torch.allclose(stepped, check())  # was: the packed copy of the step before (the summary's 0.41)
    m.load_state_dict(other.state_dict())
    check()
    w = m.layers[0].feed_forward.w13.weight
    w.data = torch.randn_like(w)  # another tensor, the old one held by the packed copy: not at the same address
    check()


@pytest.mark.parametrize("case", ["1 row", "3 rows", "autograd", "float64", "one-pass forward"])
def test_no_packing_where_it_does_not_apply(case):
    m = tiny(dtype=torch.float64 if case == "float64" else torch.float32)
    if case == "one-pass forward":
        with torch.no_grad():
            m(torch.arange(7)[None] % V, LAYOUT.coords(2)[:7])
    else:
        one_pass(m, {"1 row": 1, "3 rows": 3}.get(case, 7), grad=case == "autograd")
    assert not packed(m)
    with torch.no_grad():  # the rule itself, for 7 rows of the model's dtype
        assert packs_rows(torch.zeros(1, 7, 32, dtype=m.output.weight.dtype), m.output.weight) == (case != "float64")
