"""The CUDA paths, checked on CPU: what the first GPU run would otherwise find out the hard way.

`pytest -k "cuda_branch or recompile or reinplace"` selects its three regression tests:
- flex attention's CUDA branch, forced on CPU, compiles inside activation-checkpointed, per-block compiled blocks
  (a global written while tracing broke the graph and left every block eager);
- per-block compile keeps static shapes when a second sequence length comes (DiagD after causal), instead of
  recompiling every block with symbolic sizes;
- the compiled sampler step writes the KV cache in place (no loop over the whole cache buffer), with the eager
  tokens.
"""
import re
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import mcar.core.model as model_module
from mcar.core.layout import Layout
from mcar.core.masks import build_mask_factory
from mcar.core.model import ModelConfig, Transformer
from mcar.core.sampler import ScheduleSampler, forward_rows
from mcar.train.parallel import apply_activation_checkpointing, apply_compile

LAYOUT, FRAMES = Layout(3, 4, 2), 3


def tiny_model(n_layers=2, n_kv_heads=None):
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=40, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=n_kv_heads,
                                   mlp_dim=64))


def test_flex_cuda_branch_compiles_one_graph_under_activation_checkpointing(monkeypatch):
    """The paper setting's path (experiment=paper: activation checkpointing + per-block compile + flex BlockMask)
    with flex's CUDA branch taken on CPU: one graph for all blocks, no graph break."""
    monkeypatch.setattr(model_module, "_wants_compiled_flex", lambda q: True)
    monkeypatch.setattr(model_module, "_flex_compiled", None)
    torch._dynamo.reset()
    m = tiny_model()
    apply_activation_checkpointing(m)
    counter = CompileCounter()
    apply_compile(m, backend=counter)
    batch = build_mask_factory("diagd", LAYOUT, FRAMES, backend="flex")(torch.randint(0, 32, (2, LAYOUT.n_slots(3))))
    with torch.no_grad():  # flex has no backward on CPU; the forward is what dynamo traces
        out = m(batch.tokens, batch.coords, batch.mask)
    breaks = torch._dynamo.utils.counters["graph_break"]
    torch._dynamo.reset()
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for {len(m.layers)} blocks (0: blocks run eagerly)"
    assert not breaks, dict(breaks)
    assert torch.isfinite(out).all()


def test_block_compile_does_not_recompile_with_dynamic_shapes_when_the_mask_changes():
    """Causal then DiagD (a longer sequence: proxy rows) through the same compiled blocks, as the GPU check and a
    fine-tuning run's validation do: each length gets its own graph with static sizes."""
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append([x for x in example_inputs if isinstance(x, torch.SymInt)
                       or (isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape))])
        return gm

    m = tiny_model()
    apply_activation_checkpointing(m)
    apply_compile(m, backend=capture)  # the defaults MCARModule.configure_model uses
    lengths = []
    for name in ("causal", "diagd"):
        batch = build_mask_factory(name, LAYOUT, FRAMES, backend="sdpa")(torch.randint(0, 32, (2, LAYOUT.n_slots(3))))
        m(batch.tokens, batch.coords, batch.mask).sum().backward()
        lengths.append(batch.tokens.shape[1])
    torch._dynamo.reset()
    assert lengths[1] > lengths[0]
    assert len(graphs) == 2, f"{len(graphs)} graphs for two sequence lengths"
    assert graphs == [[], []], f"symbolic sizes in a recompiled graph: {graphs}"


def loop_bounds(code: str) -> list[int]:
    """The trip counts of the loops in inductor's generated C++ kernels."""
    return [int(b) for b in
            re.findall(r"for\(int64_t \w+=static_cast<int64_t>\(0L\); \w+<static_cast<int64_t>\((\d+)L\)", code)]


def whole_buffer_loops(code: str, buf: torch.Tensor) -> int:
    """Loops of inductor's C++ kernels that run over the cache buffer's rows (or all its elements)."""
    B, H, R, D = buf.shape
    return sum(b in (R, R * D, H * R * D, B * H * R * D) for b in loop_bounds(code))


@pytest.mark.slow
def test_compiled_cache_write_is_reinplaced_with_the_eager_tokens():
    """A DiagD pass compiled by inductor (static shapes, CPU) writes its keys and values into the cache buffer in
    place: no generated loop touches the whole buffer. A write through a second view of the buffer after the
    attention read cost 2 such loops per layer here (4.8 buffer passes per K and V per layer on the GPU review)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    frames = 4
    m = tiny_model(n_layers=2, n_kv_heads=2).eval()
    clip = torch.randint(0, 32, (1, LAYOUT.n_slots(frames)))
    eager = ScheduleSampler(LAYOUT, frames, 1, k=2, temperature=0)
    want, _ = eager.generate(m, clip)
    sched = eager.schedule()
    static = ScheduleSampler(LAYOUT, frames, 1, k=2, static=True, temperature=0)
    plan = static.static_plan(sched, "cpu")
    m.setup_cache(1, sched.n_slots + 1)
    m.reset_cache()
    tokens = torch.cat([clip, clip[:, :1]], 1)
    step = torch.compile(forward_rows, dynamic=False)
    p = max(plan.passes, key=lambda a: a.mask.shape[-1])  # the widest cache prefix
    with torch.no_grad():
        _, codes = run_and_get_code(step, m, tokens, p)
    buf = m.layers[0].attention.cache.k_buf
    assert p.src.shape[-1] > 1 and buf.shape[2] not in p.mask.shape  # a real pass; the buffer's size is unique
    code = "\n".join(codes)
    # the loop pattern still reads inductor's code (~60 loops here): 0 whole-buffer loops is not 0 loops found
    assert len(loop_bounds(code)) >= 20, f"{len(loop_bounds(code))} loops found: has inductor's loop format changed?"
    assert whole_buffer_loops(code, buf) == 0
    torch._dynamo.reset()
    compiled = ScheduleSampler(LAYOUT, frames, 1, k=2, compile=True, temperature=0)
    with torch.no_grad():
        got, _ = compiled.generate(m, clip)
    torch._dynamo.reset()
    assert torch.equal(got, want)


# ---- the training step on CUDA: no host sync per step, fp32 matmuls on tensor cores, MFU over computed rows ----
class PendingEvent:
    """A CUDA event stand-in: not done until synchronised."""

    def __init__(self):
        self.waited = False

    def query(self):
        return self.waited

    def synchronize(self):
        self.waited = True


def test_loss_watch_never_waits_for_a_step_and_reads_every_flag_before_a_checkpoint():
    from mcar.train.module import LossWatch

    watch = LossWatch(deferred=True)
    watch.push(torch.tensor(2.0), 0)
    assert watch.poll() is None and not watch.pending  # done (no event on CPU): read and dropped
    nan, event = torch.tensor(float("nan")), PendingEvent()
    watch.pending.append((7, nan, torch.isfinite(nan), event))
    assert watch.poll() is None and not event.waited  # the step's flag is not ready: nobody waits for it
    assert watch.poll(wait=True) == (7, pytest.approx(float("nan"), nan_ok=True)) and event.waited
    immediate = LossWatch(deferred=False)
    immediate.push(torch.tensor(float("inf")), 3)
    assert immediate.poll() == (3, float("inf"))


def test_a_checkpoint_of_a_step_with_a_non_finite_loss_is_refused():
    from mcar.train.module import LossWatch, MCARModule

    module = MCARModule(arch=dict(vocab_size=40, dim=32, n_layers=1, n_heads=4, mlp_dim=64),
                        layout=dict(h=3, w=4, n_a=2), clip_frames=3, mask={"name": "causal"}, optim={}, max_steps=1)
    module._loss_watch = LossWatch(deferred=True)
    nan = torch.tensor(float("nan"))
    module._loss_watch.pending.append((5, nan, torch.isfinite(nan), PendingEvent()))
    with pytest.raises(FloatingPointError, match="training loss is nan at step 5"):
        module.on_save_checkpoint({})


def test_fp32_matmuls_use_tensor_cores_where_the_trainer_runs_on_cuda(monkeypatch, tmp_path):
    """The helper, and build_trainer calling it with the strategy's device: a CPU trainer leaves fp32 matmuls
    alone; the same trainer with its root device pretending to be CUDA (no GPU needed) sets "high"."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from mcar.train.task import build_trainer, use_tensor_cores_for_fp32

    from .conftest import SMALL_DATA, compose

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        use_tensor_cores_for_fp32(torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == "highest"
        use_tensor_cores_for_fp32(torch.device("cuda", 0))
        assert torch.get_float32_matmul_precision() == "high"

        cfg = compose("train", [*SMALL_DATA, f"paths.checkpoint_root={tmp_path}/ckpt", "logger=none",
                                "trainer.accelerator=cpu"])
        torch.set_float32_matmul_precision("highest")
        build_trainer(cfg.copy(), str(tmp_path / "cpu"))
        assert torch.get_float32_matmul_precision() == "highest"
        monkeypatch.setattr(SingleDeviceStrategy, "root_device", property(lambda self: torch.device("cuda", 0)))
        trainer = build_trainer(cfg.copy(), str(tmp_path / "cuda"))
        assert trainer.strategy.root_device.type == "cuda"
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_mfu_counts_every_row_the_diagd_step_computes():
    """Oracle: 6N + 12 L dim (visible keys per row) FLOPs per computed row, written out here; DiagD computes the
    clip's slots plus (h-1) proxy rows per generated frame."""
    from mcar.train.module import MCARModule

    arch = dict(vocab_size=40, dim=32, n_layers=2, n_heads=4, mlp_dim=64)
    module = MCARModule(arch=arch, layout=dict(h=3, w=4, n_a=2), clip_frames=3, mask={"name": "diagd"}, optim={},
                        max_steps=1)
    rows = 3 * 14 + (3 - 1) * 2
    assert module.rows_per_clip == rows
    n = sum(p.numel() for name, p in module.model.named_parameters() if "tok_embeddings" not in name)
    dense = module.mask_factory.table().dense()
    visible_keys = dense.sum().item() / rows
    assert module.step_flops(8) == pytest.approx(8 * rows * (6 * n + 12 * 2 * 32 * visible_keys))


# device name -> dense bf16 peak (FP32 accumulate, no sparsity); None: not in the table (no MFU without peak_flops=)
PEAKS = {"NVIDIA H100 80GB HBM3": 989e12, "H100 SXM": 989e12, "NVIDIA H100 PCIe": 756e12,
         "NVIDIA H100 80GB HBM2e": 756e12, "NVIDIA H100 NVL": 835e12, "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12,
         "NVIDIA GH200 480GB": 989e12, "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100 80GB PCIe": 312e12,
         "NVIDIA L40S": 362e12, "NVIDIA L40": 181e12, "NVIDIA L4": 121e12, "NVIDIA A10G": 125e12,
         "NVIDIA GeForce RTX 4090": 165.2e12, "Tesla T4": None, "NVIDIA H100": None}
# where Lightning's _CUDA_FLOPS (2.6) gives another bf16 figure, and why we do not take it (mcar/core/flops.py)
LIGHTNING_DIFFERS = {"NVIDIA H200": None,  # its "h200 sxm1" row (2.0e15, with sparsity) needs "sxm1" in the name
                     "NVIDIA H200 NVL": None,  # likewise "nvl1" (1.7e15, with sparsity)
                     "NVIDIA H100 NVL": 1978.8e12,  # with sparsity
                     "NVIDIA GH200 480GB": None,  # no row
                     "NVIDIA L40S": 121e12,  # the L4's row: "l4" is in the name
                     "NVIDIA L40": 121e12,  # likewise (its own L40 row, 181e12, needs "tesla" in the name)
                     "NVIDIA GeForce RTX 4090": 82.6e12}  # its TF32 figure


def test_peak_flops_knows_each_variant_and_agrees_with_lightning_or_says_why_not(monkeypatch):
    from lightning.fabric.utilities.throughput import get_available_flops

    from mcar.core.flops import mfu, peak_of

    assert {name: peak_of(name) for name in PEAKS} == PEAKS
    assert peak_of("nvidia h100 pcie") == 756e12  # case-insensitive, as Lightning
    for name, ours in PEAKS.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning warns about the names it does not know
            theirs = get_available_flops(torch.device("cuda", 0), torch.bfloat16)
        want = LIGHTNING_DIFFERS.get(name, ours)
        assert theirs == pytest.approx(want, rel=1e-3) if want else theirs is None, (name, theirs, want)
    assert mfu(4e14, 1.0, 989e12, 2) == pytest.approx(4e14 / 1.978e15) and mfu(1.0, 1.0, None) is None


def test_peak_bandwidth_knows_each_variant():
    """The bandwidth floor's table tells the H100 variants apart as the peak-FLOPs table does (an H100 reporting
    HBM2e is a PCIe card: 2.0 TB/s, not the SXM's 3.35) and leaves an ambiguous name to bench.bandwidth."""
    from mcar.core.flops import bandwidth_of

    want = {"NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H100 PCIe": 2.0e12, "NVIDIA H100 80GB HBM2e": 2.0e12,
            "NVIDIA H100 NVL": 3.9e12, "NVIDIA H200": 4.8e12, "NVIDIA H200 NVL": 4.8e12,
            "NVIDIA A100-SXM4-80GB": 2.0e12, "NVIDIA A100-SXM4-40GB": 1.555e12, "NVIDIA H100": None,
            "NVIDIA GH200 480GB": None}
    assert {name: bandwidth_of(name) for name in want} == want


def test_the_cached_attention_kernel_is_chosen_by_us_not_by_the_trace(monkeypatch):
    """The cached passes run under our SDPA backend list (memory-efficient on CUDA, as the per-pass plan assumes):
    the H100 emulation's trace picked cuDNN attention by itself."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def record(*args, **kwargs):
        b = torch.backends.cuda
        seen.append((b.mem_efficient_sdp_enabled(), b.flash_sdp_enabled(), b.cudnn_sdp_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", record)
    m = tiny_model().eval()
    clip = torch.randint(0, 32, (1, LAYOUT.n_slots(FRAMES)))
    with torch.no_grad():
        ScheduleSampler(LAYOUT, FRAMES, 1, k=2, temperature=0).generate(m, clip)
    assert seen and set(seen) == {(True, True, False)}
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after each call


def test_residual_dtype_reaches_the_model_and_a_bad_one_names_the_field():
    from mcar.train.module import MCARModule

    kw = dict(arch=dict(vocab_size=40, dim=32, n_layers=1, n_heads=4, mlp_dim=64), layout=dict(h=3, w=4, n_a=2),
              clip_frames=3, mask={"name": "causal"}, optim={}, max_steps=1)
    assert MCARModule(**kw).model.residual_dtype is None
    assert MCARModule(**kw, residual_dtype="bfloat16").model.residual_dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"residual_dtype='fp16': one of \['bfloat16', 'float32'\]"):
        MCARModule(**kw, residual_dtype="fp16")
