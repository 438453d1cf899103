"""normkit.torch against torch.nn.RMSNorm / LayerNorm and a Llama-style RMSNorm, eager and compiled.

``python -m normkit.bench.torch [--quick] [--device D] [--dtype T]`` prints the table;
`normkit.bench.core.run` of this module returns the rows in `normkit.bench`'s schema. Every group
also times ``x.clone()`` of the same bytes (the copy floor); on CUDA a throughput sample is timed
by CUDA events (`CudaEvents`), a latency sample by the host's clock after a
``torch.cuda.synchronize``. Eager forward+backward rows carry
``saved_for_backward_bytes`` (distinct storages autograd saves, parameters excluded, from
``torch.autograd.graph.saved_tensors_hooks``); rows on CUDA carry ``peak_memory_bytes``.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from normkit.bench.core import EPS, Group, Sweep, backend_main, plan_groups, time_group
from normkit.bridges import TorchBridge
from normkit.torch.modules import LayerNorm, PartialRMSNorm, RMSNorm

__all__ = [
    "CudaEvents", "LlamaRMSNorm", "cpu_kernel", "measure", "plan", "saved_bytes", "versions",
]

EAGER, COMPILED = "eager", "torch.compile"
devices = TorchBridge().devices
QUICK_COMPILED = ("normkit.torch.RMSNorm", "torch.nn.RMSNorm")
LIGER = "Liger RMSNorm (Triton)"
NOT_COMPILED = ("normkit.torch.PartialRMSNorm(p=0.0625)", LIGER)
# On the CPU "auto" runs normkit's numba kernel; these rows time the torch-ops path beside it.
COMPOSITE = (
    "normkit.torch.RMSNorm(kernel='composite')", "normkit.torch.LayerNorm(kernel='composite')"
)
# On CUDA "auto" runs the Triton kernels for half inputs and torch's fused kernels for float32;
# these rows time the Triton kernels in every dtype.
TRITON = ("normkit.torch.RMSNorm(kernel='triton')", "normkit.torch.LayerNorm(kernel='triton')")


class LlamaRMSNorm(nn.Module):
    """Hugging Face's ``LlamaRMSNorm`` in plain torch ops: normalize in float32, cast, scale."""

    def __init__(self, hidden_size: int, eps: float = EPS, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _liger(n: int, dtype: torch.dtype, device: str) -> dict[str, nn.Module]:
    """Liger-Kernel's Triton RMSNorm (Llama casting) on CUDA, where it is installed; ``in_place``
    off, since the bench's ``dy`` is shared by every implementation of a group."""
    if not device.startswith("cuda") or importlib.util.find_spec("liger_kernel") is None:
        return {}
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    return {LIGER: LigerRMSNorm(n, eps=EPS, in_place=False).to(device, dtype)}


def _modules(n: int, dtype: torch.dtype, device: str) -> dict[str, nn.Module]:
    kw: dict[str, Any] = {"dtype": dtype, "device": device}
    return {
        **_liger(n, dtype, device),
        "normkit.torch.RMSNorm": RMSNorm(n, EPS, **kw),
        "torch.nn.RMSNorm": nn.RMSNorm(n, EPS, **kw),
        "Llama RMSNorm (torch ops)": LlamaRMSNorm(n, EPS, **kw),
        "normkit.torch.PartialRMSNorm(p=0.0625)": PartialRMSNorm(n, 0.0625, EPS, **kw),
        "normkit.torch.LayerNorm": LayerNorm(n, EPS, **kw),
        "torch.nn.LayerNorm": nn.LayerNorm(n, EPS, **kw),
        **({
            COMPOSITE[0]: RMSNorm(n, EPS, kernel="composite", **kw),
            COMPOSITE[1]: LayerNorm(n, EPS, kernel="composite", **kw),
        } if device == "cpu" else {}),
        **({
            TRITON[0]: RMSNorm(n, EPS, kernel="triton", **kw),
            TRITON[1]: LayerNorm(n, EPS, kernel="triton", **kw),
        } if device.startswith("cuda") and importlib.util.find_spec("triton") else {}),
    }


def saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves for ``module(x)``'s backward."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x.detach().requires_grad_(True))
    return sum(seen.values())


def _forward(
    module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> Callable[[], object]:
    def fn() -> object:
        with torch.no_grad():
            return module(x)

    return fn


def _forward_backward(
    module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dy: torch.Tensor
) -> Callable[[], object]:
    leaf = x.detach().requires_grad_(True)

    def fn() -> object:
        leaf.grad = None
        module(leaf).backward(dy)
        return leaf.grad

    return fn


def _wait(device: str) -> Callable[[object], object] | None:
    """Blocks until the device has run what was queued (None on the CPU: a call computes its
    result before it returns)."""
    if device.startswith("cuda"):
        return lambda _: torch.cuda.synchronize(device)
    if device == "mps":
        return lambda _: torch.mps.synchronize()
    return None


class CudaEvents:
    """A throughput sample's time on a CUDA device: events recorded on the current stream before
    the first call and after the last, and the time the device measured between them."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.began = torch.cuda.Event(enable_timing=True)
        self.ended = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self.began.record(torch.cuda.current_stream(self.device))

    def stop(self, result: object) -> float:
        self.ended.record(torch.cuda.current_stream(self.device))
        self.ended.synchronize()
        return float(self.began.elapsed_time(self.ended)) / 1e3


def _peak_bytes(fn: Callable[[], object], device: str) -> int:
    """CUDA memory allocated at the peak of one call, above what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def versions() -> dict[str, str]:
    """The versions and threads this benchmark ran with, and how normkit's CPU kernel was
    made ready (`cpu_kernel`)."""
    found = {"torch": torch.__version__, "threads": str(torch.get_num_threads())}
    try:
        import numba
    except ImportError:
        return found
    return {**found, "numba": numba.__version__, "CPU kernel": cpu_kernel()}


@functools.cache
def cpu_kernel() -> str:
    """normkit's CPU kernel compiled (or loaded from the cache) before any group is timed, and
    how: ``kernel="auto"`` runs it only in a process that finds it compiled, and on a machine
    that has not compiled it would time the composite path in its place."""
    from normkit.torch.warmup import compile_now

    said: list[str] = []
    began = time.perf_counter()
    if compile_now(say=said.append) != 0:
        return f"not compiled ({said[-1]})"
    if any(": compiled in " in line for line in said):
        return f"compiled by this run ({time.perf_counter() - began:.0f} s)"
    return "compiled (cached)"


def plan(sweep: Sweep) -> list[Group]:
    """Eager groups everywhere; compiled ones too (with ``quick``: one, the first
    forward+backward)."""
    first_dtype = {d: sweep.dtypes_on(d)[0] for d in devices()}

    def modes(device: str, dtype: str, pass_: str, shape_index: int) -> list[str]:
        compiled = not sweep.quick or (
            shape_index == 0 and dtype == first_dtype[device] and pass_ == "forward+backward"
        )
        return [EAGER, COMPILED] if compiled else [EAGER]

    return plan_groups("torch", sweep, devices(), modes)


def measure(group: Group, sweep: Sweep) -> list[dict[str, Any]]:
    """Time one group: its modules, interleaved with ``clone`` of the same bytes."""
    dtype = getattr(torch, group.dtype)
    gen = torch.Generator(group.device).manual_seed(0)  # on the device: no copy of 32M values

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=group.device).to(dtype)

    x, dy, buffer = randn(*group.shape), randn(*group.shape), randn(group.copy_elements)
    modules = _modules(group.shape[1], dtype, group.device)
    extras: dict[str, dict[str, Any]] = {}
    if group.mode == COMPILED:
        # each group compiles afresh: else the groups' shapes and dtypes exhaust the recompile limit
        torch._dynamo.reset()
        skipped = NOT_COMPILED + COMPOSITE
        names = QUICK_COMPILED if sweep.quick else [k for k in modules if k not in skipped]
        calls: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            k: torch.compile(modules[k], fullgraph=True) for k in names
        }
    else:
        calls = dict(modules)
        if group.backward:
            extras = {
                k: {"saved_for_backward_bytes": saved_bytes(m, x)} for k, m in modules.items()
            }
    candidates = {
        k: _forward_backward(m, x, dy) if group.backward else _forward(m, x)
        for k, m in calls.items()
    }
    on_cuda = group.device.startswith("cuda")
    rows = time_group(
        group,
        sweep,
        candidates,
        ("copy (clone)", buffer.clone),
        wait=_wait(group.device),
        stopwatch=CudaEvents(group.device) if on_cuda else None,
        extras=extras,
    )
    if on_cuda:
        peaks = {k: _peak_bytes(fn, group.device)
                 for k, fn in {**candidates, "copy (clone)": buffer.clone}.items()}
        for row in rows:
            row["peak_memory_bytes"] = peaks[row["implementation"]]
    return rows


if __name__ == "__main__":
    backend_main(sys.modules[__name__])
