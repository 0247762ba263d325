"""finetune.py grow_layers=N: a deeper model that starts as init_from's function (LLaMA Pro's block expansion)."""
import pytest
import torch

from mcar.core.layout import Layout
from mcar.core.model import ModelConfig, Transformer
from mcar.train.finetune import grown_state
from tests.conftest import SMALL_DATA, job_overrides, run_in_process

ARCH = dict(vocab_size=40, dim=32, n_layers=3, n_heads=2, mlp_dim=64)


def model_of(state: dict, n_layers: int) -> Transformer:
    model = Transformer(ModelConfig(**dict(ARCH, n_layers=n_layers)))
    model.load_state_dict({k[len("model."):]: v for k, v in state.items()})
    return model.eval()


@pytest.mark.parametrize("new_layers", [4, 6, 7])
def test_a_grown_model_predicts_as_the_one_it_grew_from(new_layers):
    """Same tokens in, same logits out at every depth; the new blocks copy the block before them but for their
    zeroed residual outputs, spread evenly (6 from 3: old, new, old, new, old, new)."""
    torch.manual_seed(0)
    old = Transformer(ModelConfig(**ARCH)).eval()
    state = {f"model.{k}": v for k, v in old.state_dict().items()}
    grown = grown_state(state, 3, new_layers)
    new = model_of(grown, new_layers)
    tokens = torch.randint(0, 40, (2, 30))
    coords = Layout(2, 3, 1).coords(3)[:30]  # 3 frames of 2x3 image tokens and 1 action: 21 slots
    tokens = tokens[:, :len(coords)]
    with torch.no_grad():
        torch.testing.assert_close(new(tokens, coords), old(tokens, coords), atol=1e-5, rtol=1e-5)
    zeroed = [i for i in range(new_layers) if not grown[f"model.layers.{i}.attention.wo.weight"].any()]
    assert len(zeroed) == new_layers - 3
    assert all(not grown[f"model.layers.{i}.feed_forward.w2.weight"].any() for i in zeroed)
    if new_layers == 6:
        assert zeroed == [1, 3, 5]
        assert torch.equal(grown["model.layers.3.attention.wqkv.weight"], state["model.layers.1.attention.wqkv.weight"])
        assert torch.equal(grown["model.layers.4.attention.wo.weight"], state["model.layers.2.attention.wo.weight"])


def test_finetune_grows_the_model_and_trains_its_new_blocks(tmp_path, tiny_checkpoint):
    """grow_layers=N fine-tunes an N-layer model from a shallower checkpoint and saves it with N layers, its new
    blocks' outputs moved off zero; N not above the checkpoint's depth is refused naming both. rope_base (here in
    the same run) is the saved model's, and the loaded model rotates with it."""
    from mcar.sampling.world_model import WorldModel
    from mcar.tools.finetune import main as finetune

    depth = torch.load(tiny_checkpoint, weights_only=False)["hyper_parameters"]["arch"]["n_layers"]
    args = [*SMALL_DATA, f"init_from={tiny_checkpoint}", "steps=2", "logger=none", "val_dashboard.n_clips=0",
            "trainer.val_check_interval=2"]
    with pytest.raises(ValueError, match=f"grow_layers={depth}: .* already has {depth} layers"):
        run_in_process(finetune, *args, f"grow_layers={depth}", *job_overrides(tmp_path, "a"))
    run_in_process(finetune, *args, f"grow_layers={2 * depth}", "rope_base=100", "run_name=grown",
                   *job_overrides(tmp_path, "b"))
    ckpt = torch.load(tmp_path / "ckpt" / "grown" / "last.ckpt", weights_only=False)
    assert ckpt["hyper_parameters"]["arch"]["rope_base"] == 100
    rope = WorldModel.load(str(tmp_path / "ckpt" / "grown" / "last.ckpt"), device="cpu").model.rope
    time_pairs = rope.sections[0]
    assert rope.inv_freq[1].item() == pytest.approx(100 ** (-1 / time_pairs))  # 10000's would be 10000 ** (-1/n)
    assert ckpt["hyper_parameters"]["arch"]["n_layers"] == 2 * depth
    assert ckpt["hyper_parameters"]["model_name"].endswith(f"_{2 * depth}layers")
    assert ckpt["state_dict"]["model.layers.1.attention.wo.weight"].abs().sum() > 0
