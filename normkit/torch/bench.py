"""Benchmark: normkit.torch against torch.nn.RMSNorm and torch.nn.LayerNorm, side by side.

``python -m normkit.torch.bench [--quick]`` prints a table; `run` returns the rows. Each row's
``ratios`` maps a peer measured in the same group to ``peer median / this median`` (above 1:
this implementation is faster). Fwd+bwd rows also carry ``saved_bytes``, the bytes autograd
saved for backward (distinct storages, parameters excluded), measured with
``torch.autograd.graph.saved_tensors_hooks``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

from normkit import timing
from normkit.torch.modules import LayerNorm, PartialRMSNorm, RMSNorm

__all__ = ["run", "saved_bytes"]

EPS = 1e-6


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


def _forward(module: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    def fn() -> object:
        with torch.no_grad():
            return module(x)

    return fn


def _forward_backward(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], object]:
    leaf = x.detach().requires_grad_(True)

    def fn() -> object:
        leaf.grad = None
        module.zero_grad(set_to_none=True)
        module(leaf).backward(dy)
        return leaf.grad

    return fn


def _group(
    rows: list[dict], pass_: str, candidates: dict[str, Callable[[], object]], x: torch.Tensor,
    repeats: int, extra: dict[str, dict] | None = None,
) -> None:
    timings = timing.interleaved(candidates, warmup=2, repeats=repeats)
    for name, t in timings.items():
        rows.append({
            "implementation": name,
            "pass": pass_,
            "shape": tuple(x.shape),
            "dtype": str(x.dtype).removeprefix("torch."),
            "device": str(x.device),
            "median_s": t.median_s,
            "ratios": {p: timings[p].median_s / t.median_s for p in timings if p != name},
            **(extra or {}).get(name, {}),
        })


def run(quick: bool = False) -> list[dict]:
    """Time the layers on CPU float32 (8192 x 4096; 1024 x 4096 with ``quick``).

    Groups, each timed interleaved: eager forward, eager forward+backward, and (unless
    ``quick``) forward+backward under ``torch.compile``. Returns one dict per implementation and
    group: implementation, pass, shape, dtype, device, median_s, ratios (+ saved_bytes).
    """
    rows_n, n = (1024, 4096) if quick else (8192, 4096)
    repeats = 5 if quick else 15
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows_n, n, generator=gen)
    dy = torch.randn(rows_n, n, generator=gen)
    modules: dict[str, nn.Module] = {
        "normkit.RMSNorm": RMSNorm(n, EPS),
        "torch.nn.RMSNorm": nn.RMSNorm(n, EPS),
        "torch.nn.LayerNorm": nn.LayerNorm(n, EPS),
        "normkit.PartialRMSNorm(p=0.0625)": PartialRMSNorm(n, 0.0625, EPS),
        "normkit.LayerNorm": LayerNorm(n, EPS),
    }
    results: list[dict] = []
    _group(results, "forward", {k: _forward(m, x) for k, m in modules.items()}, x, repeats)
    memory = {k: {"saved_bytes": saved_bytes(m, x)} for k, m in modules.items()}
    backward = {k: _forward_backward(m, x, dy) for k, m in modules.items()}
    _group(results, "forward+backward", backward, x, repeats, memory)
    if not quick:
        compiled = {
            f"compile({k})": _forward_backward(torch.compile(modules[k], fullgraph=True), x, dy)
            for k in ("normkit.RMSNorm", "torch.nn.RMSNorm")
        }
        _group(results, "forward+backward", compiled, x, repeats)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1024 x 4096, no torch.compile")
    args = parser.parse_args(argv)
    rows = run(quick=args.quick)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    header = f"{'pass':<17} {'implementation':<40} {'median ms':>9}  {'saved MiB':>9}"
    print(f"{header}  ratios (peer/this)")
    for row in rows:
        saved = row.get("saved_bytes")
        ratios = ", ".join(f"{p} {r:.2f}" for p, r in row["ratios"].items())
        print(
            f"{row['pass']:<17} {row['implementation']:<40} {row['median_s'] * 1e3:9.2f}  "
            f"{'' if saved is None else f'{saved / 2**20:9.2f}':>9}  {ratios}"
        )


if __name__ == "__main__":
    main()
