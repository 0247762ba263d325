"""How the samplers compile their per-pass step: CUDA graphs on CUDA, inductor's C++ wrapper on CPU."""
from __future__ import annotations

import types

import torch
import torch.fx.experimental._config as shape_config

# dynamic: bucket shapes differ by design; one symbolic trace serves them all, and CUDA graph trees record one graph
# per bucket shape. dynamic=False would recompile the model per bucket.
COMPILE_OPTIONS = dict(mode="reduce-overhead", dynamic=True)
# CPU (no CUDA graphs): inductor's C++ wrapper calls the pass's kernels without a line of Python each; at batch 1 a
# pass is mostly per-kernel overhead (mcar.play on the shipped model: 1.6x, BENCHMARKS.md)
CPU_COMPILE_OPTIONS = dict(dynamic=True, options={"cpp_wrapper": True})


def compiled(fn, device):
    # compiled from a copy of fn's code: dynamo keeps graphs, and its limit of 8 recompiles, per code object, and
    # each sampler adds one or two (top-k/top-p on or off, batch widths): samplers sharing one would run out
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    step = torch.compile(own, **(COMPILE_OPTIONS if torch.device(device).type == "cuda" else CPU_COMPILE_OPTIONS))
    return one_trace_per_step(step)


def one_trace_per_step(step):
    """The settings under which one trace serves every pass of a sampler.

    specialize_float: every Python float a step reads is a model constant (each RMSNorm's eps: 41 at 20 layers); the
    per-call ones (temperature, top_p) come as tensors. Under dynamic=True dynamo would make each a CPU float64
    graph input: a host kernel and a host-to-device copy before every CUDA graph replay.

    use_duck_shape off: by default sizes equal at the first trace share one symbol (a pass of 5 rows and 5 outputs,
    rows equal to the coordinates' 4 columns), and the next pass where they differ fails that guard: a recompile."""
    step = torch._dynamo.config.patch(specialize_float=True)(step)
    return shape_config.patch(use_duck_shape=False)(step)
