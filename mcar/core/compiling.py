"""How the samplers compile their per-pass step: CUDA graphs on CUDA, inductor's C++ wrapper on CPU."""
from __future__ import annotations

import types

import torch

# dynamic: bucket shapes differ by design; one symbolic trace serves them all (a few more for sizes 1), and
# CUDA graph trees record one graph per bucket shape. dynamic=False would recompile the model per bucket.
COMPILE_OPTIONS = dict(mode="reduce-overhead", dynamic=True)
# CPU (no CUDA graphs): inductor's C++ wrapper calls the pass's kernels without a line of Python each; at batch 1 a
# pass is mostly per-kernel overhead (mcar.play on the shipped model: 1.6x, BENCHMARKS.md)
CPU_COMPILE_OPTIONS = dict(dynamic=True, options={"cpp_wrapper": True})


def compiled(fn, device):
    # compiled from a copy of fn's code: dynamo keeps graphs, and its limit of 8 recompiles, per code object, and
    # each sampler adds a few (sizes 1, top-k/top-p on or off): samplers sharing one would run out
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    step = torch.compile(own, **(COMPILE_OPTIONS if torch.device(device).type == "cuda" else CPU_COMPILE_OPTIONS))
    return constant_floats(step)


def constant_floats(step):
    """Every Python float a sampler step reads is a model constant (each RMSNorm's eps: 41 at 20 layers); the
    per-call ones (temperature, top_p) come as tensors. Under dynamic=True dynamo would make each a CPU float64
    graph input: a host kernel and a host-to-device copy before every CUDA graph replay."""
    return torch._dynamo.config.patch(specialize_float=True)(step)
