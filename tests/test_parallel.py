"""Training at scale on CPU: the GPU trainer settings (bf16-mixed, fused AdamW, clipping), activation
checkpointing, FSDP2 over 2 gloo processes with exact resume, and compiled blocks left alone by the dashboard."""
import copy
import csv
from pathlib import Path

import hydra
import pytest
import torch
from lightning.pytorch.utilities.enums import GradClipAlgorithmType

from mcar.core.layout import Layout
from mcar.core.masks import build_mask_factory
from mcar.core.model import ModelConfig, Transformer
from mcar.core.sampler import build_sampler
from mcar.train.dashboard import generate_eager
from mcar.train.module import MCARModule
from mcar.train.parallel import apply_activation_checkpointing, apply_compile, is_checkpointed

from .conftest import SMALL_DATA, compose, job_overrides, run_script

LAYOUT = Layout(3, 4, 2)


def metrics(run_dir: Path, key: str) -> dict[int, float]:
    rows = csv.DictReader(open(next(run_dir.glob("csv/version_*/metrics.csv"))))
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


def tiny_model(**kw) -> Transformer:
    return Transformer(ModelConfig(vocab_size=40, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, mlp_dim=64, **kw))


def test_activation_checkpointing_gives_identical_gradients():
    torch.manual_seed(0)
    plain = tiny_model()
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt)
    assert all(is_checkpointed(b) for b in ckpt.layers) and not any(is_checkpointed(b) for b in plain.layers)
    assert list(ckpt.state_dict()) == list(plain.state_dict())  # checkpoints stay interchangeable
    backward_on_a_diagd_batch(plain, ckpt)
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(a.grad, b.grad), name


def backward_on_a_diagd_batch(*models) -> None:
    factory = build_mask_factory("diagd", LAYOUT, 3, k=1, backend="sdpa")
    batch = factory(torch.randint(0, 40, (2, LAYOUT.n_slots(3))))
    for model in models:
        logits = model(batch.tokens, batch.coords, batch.mask)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=-100).backward()


def module_with_grads() -> MCARModule:
    torch.manual_seed(0)
    m = MCARModule(arch=dict(vocab_size=40, dim=32, n_layers=2, n_heads=4, mlp_dim=64), layout=vars(LAYOUT),
                   clip_frames=3, mask={"name": "causal"}, optim={}, max_steps=10)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    return m


# what Lightning passes (trainer.gradient_clip_algorithm)
@pytest.mark.parametrize("algorithm", list(GradClipAlgorithmType))
def test_clipping_clips_and_logs_the_norm_before_clipping(monkeypatch, algorithm):
    m = module_with_grads()
    logged = {}
    monkeypatch.setattr(m, "log", lambda name, value, **_: logged.__setitem__(name, float(value)))
    before = [p.grad.clone() for p in m.parameters()]
    norm = torch.cat([g.flatten() for g in before]).double().norm().item()  # independent of torch's clip utils
    m.configure_gradient_clipping(None, gradient_clip_val=0.5, gradient_clip_algorithm=algorithm)
    assert logged["train/grad_norm"] == pytest.approx(norm, rel=1e-5)
    after = torch.cat([p.grad.flatten() for p in m.parameters()])
    if algorithm == "norm":
        assert after.norm().item() == pytest.approx(0.5, rel=1e-4)
        assert torch.allclose(after, torch.cat([g.flatten() for g in before]) * 0.5 / norm, rtol=1e-4)
    else:
        assert after.abs().max().item() == pytest.approx(0.5)
    m.configure_gradient_clipping(None, gradient_clip_val=None)  # no clipping: the norm is still logged
    assert logged["train/grad_norm"] == pytest.approx(after.double().norm().item(), rel=1e-5)


def test_gpu_trainer_settings_train_on_cpu(tmp_path):
    """trainer=gpu (bf16-mixed, fused AdamW, gradient clipping) on a CPU accelerator: the first optimizer step used
    to raise in Lightning's precision plugin."""
    cfg = compose("train", ["trainer=gpu"])
    assert (cfg.trainer.precision, cfg.trainer.gradient_clip_val) == ("bf16-mixed", 1.0)
    run_script("train.py", "trainer=gpu", "trainer.accelerator=cpu", "trainer.max_steps=3", "logger=csv",
               "log_every_n_steps=1", "trainer.val_check_interval=3", "val_dashboard.n_clips=0", *SMALL_DATA,
               *job_overrides(tmp_path))
    norms, loss = metrics(tmp_path / "out", "train/grad_norm"), metrics(tmp_path / "out", "train/loss")
    assert sorted(norms) == sorted(loss) == [0, 1, 2]
    assert all(0 < v < float("inf") for v in [*norms.values(), *loss.values()])


def test_fsdp_config_is_fsdp2_over_every_process():
    cfg = compose("train", ["trainer=fsdp", "trainer.devices=4", "trainer.num_nodes=2"])
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    assert type(strategy).__name__ == "ModelParallelStrategy"
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (8, 1)
    assert cfg.trainer.precision == "bf16-mixed"


@pytest.mark.slow
def test_fsdp_on_two_gloo_processes_matches_ddp_and_resumes_exactly(tmp_path):
    """trainer=fsdp (Lightning ModelParallelStrategy + fully_shard per Block) on 2 CPU processes: the same losses as
    DDP (whose two processes see different clips), a checkpoint the plain model loads, and resumed runs
    (single-file and sharded checkpoints) that repeat the uninterrupted one exactly."""
    common = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true", "logger=csv",
              "log_every_n_steps=1", "trainer.val_check_interval=3", "val_dashboard.videos=false",
              "val_dashboard.min_steps=0",
              "checkpoint.every_n_steps=3", *SMALL_DATA]
    full = run_script("train.py", "trainer=fsdp", "trainer.max_steps=6", *common, *job_overrides(tmp_path / "full"))
    assert "FSDP2: 4 blocks + root sharded over 2 processes" in full.stdout + full.stderr
    run_script("train.py", "trainer=ddp", "trainer.max_steps=3", "record_seen_clips=true", *common,
               *job_overrides(tmp_path / "ddp"))
    seen = {}  # DDP's two processes train on different clips at every step
    for rank in (0, 1):
        lines = (tmp_path / "ddp" / "out" / f"seen_clips_rank{rank}.txt").read_text().split("\n")
        seen[rank] = {int(l.split()[0]): set(map(int, l.split()[1:])) for l in lines if l}
    assert sorted(seen[0]) == sorted(seen[1]) == [1, 2, 3]  # global step after each batch
    for step in seen[0]:
        assert not seen[0][step] & seen[1][step], f"step {step}: both ranks trained on the same clips"
    ref = metrics(tmp_path / "full" / "out", "train/loss")
    ddp = metrics(tmp_path / "ddp" / "out", "train/loss")
    assert sorted(ref) == list(range(6))
    for s in range(3):  # sharding changes where sums happen, not what is computed
        assert ddp[s] == pytest.approx(ref[s], rel=1e-5), s
    # resume from a single-file checkpoint (the default: the 6-step run's of step 3) and from per-rank shards
    # (save_distributed_checkpoint: a 3-step run's last)
    run = "train-tiny-synthetic-causal"
    single, sharded = ["trainer=fsdp", *common], ["trainer=fsdp", "trainer.strategy.save_distributed_checkpoint=true",
                                                   *common]
    run_script("train.py", "trainer.max_steps=3", *sharded, *job_overrides(tmp_path / "sharded"))
    for part, ckpt, opts, resume in (("single", tmp_path / "full" / "ckpt" / run / "step0000003.ckpt", single, None),
                                     ("sharded", tmp_path / "sharded" / "ckpt" / run / "last.ckpt", sharded, "last")):
        assert ckpt.is_dir() == (part == "sharded")
        run_script("train.py", "trainer.max_steps=6", f"ckpt_path={resume or ckpt}", *opts,
                   f"paths.checkpoint_root={tmp_path}/{part}/ckpt", f"hydra.run.dir={tmp_path}/{part}/resumed")
        resumed = metrics(tmp_path / part / "resumed", "train/loss")
        # a mid-run checkpoint carries its step's pending log line (step 2's), a finished run's last.ckpt none
        assert sorted(resumed) == ([2, 3, 4, 5] if part == "single" else [3, 4, 5])
        for s in resumed:
            assert resumed[s] == ref[s], f"{part}, step {s}: resumed {resumed[s]} != uninterrupted {ref[s]}"
    # the sharded run's checkpoint is a plain single-file one that every mcar tool reads
    state = torch.load(tmp_path / "full" / "ckpt" / run / "last.ckpt", weights_only=False, map_location="cpu")
    module = MCARModule(**{k: v for k, v in state["hyper_parameters"].items()})
    module.load_state_dict(state["state_dict"])


def test_dashboard_sampling_leaves_compiled_blocks_alone():
    """Training compile=true compiles each block; sampling from it at validation must not recompile them."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = tiny_model()
    apply_compile(model, backend="eager")  # dynamo's graph capture without inductor: cheap, counts the same
    clip = torch.randint(0, 32, (1, LAYOUT.n_slots(3)))
    factory = build_mask_factory("causal", LAYOUT, 3, backend="sdpa")
    batch = factory(clip)
    model(batch.tokens, batch.coords, batch.mask).sum().backward()
    graphs = counters["stats"]["unique_graphs"]
    sampler = build_sampler({"name": "diagd", "temperature": 0}, LAYOUT, 3, schedule={"k": 2})
    model.eval()
    with torch.no_grad():
        tokens, _ = generate_eager(sampler, model, clip)
        assert counters["stats"]["unique_graphs"] == graphs
        again, _ = sampler.generate(model, clip)  # the same without the eager stance: recompiles (the old bug)
    assert counters["stats"]["unique_graphs"] > graphs
    assert torch.equal(tokens, again)


def test_checkpointed_compiled_blocks_give_the_same_gradients():
    """torchtitan's order, checkpoint wrapper then compile per block (AOT autograd, no inductor: fast on CPU)."""
    torch.manual_seed(0)
    plain = tiny_model()
    both = copy.deepcopy(plain)
    apply_activation_checkpointing(both)
    apply_compile(both, backend="aot_eager")
    backward_on_a_diagd_batch(plain, both)
    for (name, a), b in zip(plain.named_parameters(), both.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
