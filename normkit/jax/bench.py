"""normkit.jax against Flax's own norms, jitted, timed side by side (`normkit.timing`).

``python -m normkit.jax.bench [--quick]`` prints a table; `run` returns the rows.
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import normkit.jax as nkjax
from normkit.timing import Timing, interleaved

__all__ = ["run", "main"]


def _peers(kind: str) -> dict[str, nn.Module]:
    if kind == "rms":
        return {"normkit.jax.RMSNorm": nkjax.RMSNorm(), "flax.linen.RMSNorm": nn.RMSNorm()}
    return {
        "normkit.jax.LayerNorm": nkjax.LayerNorm(),
        "flax.linen.LayerNorm": nn.LayerNorm(),
        "flax.linen.LayerNorm(use_fast_variance=False)": nn.LayerNorm(use_fast_variance=False),
    }


def _workloads(module: nn.Module, x: jax.Array, dy: jax.Array) -> dict[str, Callable[[], Any]]:
    params = module.init(jax.random.key(0), x[:1])

    @jax.jit
    def forward(params, x):
        return module.apply(params, x)

    @jax.jit
    def forward_backward(params, x, dy):
        y, vjp = jax.vjp(module.apply, params, x)
        return y, vjp(dy)

    return {
        "forward": lambda: jax.block_until_ready(forward(params, x)),
        "forward+backward": lambda: jax.block_until_ready(forward_backward(params, x, dy)),
    }


def _both_orders(candidates: dict[str, Callable[[], Any]], repeats: int) -> dict[str, Timing]:
    """`interleaved` in the given order and reversed; each median is the mean of the two.

    On this CPU the candidate that runs first in each round measured 3-6 % slower than the same
    code run second; timing both orders cancels that position bias.
    """
    forward = interleaved(candidates, warmup=2, repeats=repeats)
    backward = interleaved(dict(reversed(candidates.items())), warmup=1, repeats=repeats)
    return {
        name: Timing(
            median_s=(forward[name].median_s + backward[name].median_s) / 2,
            min_s=min(forward[name].min_s, backward[name].min_s),
            max_s=max(forward[name].max_s, backward[name].max_s),
            repeats=forward[name].repeats + backward[name].repeats,
        )
        for name in candidates
    }


def run(quick: bool = False) -> list[dict]:
    """Time the normkit.jax norms and Flax's on float32 inputs, forward and forward+backward.

    Args:
      quick: a 1024 x 1024 input and fewer repeats instead of 8192 x 4096.

    Returns:
      One dict per implementation and pass: ``implementation``, ``pass``, ``shape``, ``dtype``,
      ``device``, ``median_s`` (mean of the medians of two interleaved loops, peers in opposite
      orders), ``min_s``, ``repeats`` and ``ratio_to`` (this median over each peer's, measured
      in the same loops).
    """
    shape = (1024, 1024) if quick else (8192, 4096)
    repeats = 5 if quick else 15
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    dy = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    device = str(x.devices().pop())
    rows = []
    for kind in ("rms", "layer"):
        workloads = {name: _workloads(m, x, dy) for name, m in _peers(kind).items()}
        for pass_name in ("forward", "forward+backward"):
            timings = _both_orders({name: w[pass_name] for name, w in workloads.items()}, repeats)
            for name, t in timings.items():
                rows.append(
                    {
                        "implementation": name,
                        "pass": pass_name,
                        "shape": shape,
                        "dtype": "float32",
                        "device": device,
                        "median_s": t.median_s,
                        "min_s": t.min_s,
                        "repeats": t.repeats,
                        "ratio_to": {
                            peer: t.median_s / other.median_s
                            for peer, other in timings.items()
                            if peer != name
                        },
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> None:
    """Print `run`'s rows as a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small input, few repeats")
    rows = run(quick=parser.parse_args(argv).quick)
    print(
        f"jax {jax.__version__}, flax {flax.__version__}, {platform.machine()}, "
        f"device {rows[0]['device']}, shape {rows[0]['shape']}, float32, jitted"
    )
    print(f"{'implementation':48} {'pass':17} {'median ms':>10}  ratio to peers")
    for row in rows:
        ratios = ", ".join(f"{p}: {r:.2f}" for p, r in row["ratio_to"].items())
        print(f"{row['implementation']:48} {row['pass']:17} {row['median_s'] * 1e3:10.2f}  {ratios}")


if __name__ == "__main__":
    main()
