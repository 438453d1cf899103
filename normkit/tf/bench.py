"""normkit.tf against Keras' own layers, side by side, on the TensorFlow backend.

``python -m normkit.tf.bench [--quick]`` prints the table; `run` returns its rows.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from normkit.timing import Timing, interleaved
from normkit.tf.layers import LayerNorm, RMSNorm

__all__ = ["run"]

EPS = 1e-6


def _peers() -> dict[str, dict[str, Callable[[], keras.layers.Layer]]]:
    """Groups of layers computing the same function, normkit's first."""
    return {
        "rms": {
            "normkit.tf.RMSNorm": lambda: RMSNorm(epsilon=EPS),
            "keras.layers.RMSNormalization": lambda: keras.layers.RMSNormalization(epsilon=EPS),
        },
        "layer": {
            "normkit.tf.LayerNorm": lambda: LayerNorm(epsilon=EPS),
            "keras.layers.LayerNormalization": lambda: keras.layers.LayerNormalization(epsilon=EPS),
        },
    }


def _task(
    layer: keras.layers.Layer, x: Any, dy: Any, backward: bool, jit: bool
) -> Callable[[], object]:
    import tensorflow as tf

    def forward(x: Any) -> Any:
        return layer(x)

    def forward_backward(x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return tape.gradient(y, [x, *layer.trainable_variables], output_gradients=dy)

    fn = forward_backward if backward else forward
    if jit:
        fn = tf.function(fn, jit_compile=True)
    return lambda: fn(x)


def _both_orders(candidates: dict[str, Callable[[], object]], repeats: int) -> dict[str, Timing]:
    """`interleaved` in the given order and reversed; each median is the mean of the two.

    On this kind of shared CPU the candidate that runs first in a round can measure a few percent
    slower than the same code run second; timing both orders cancels that position bias.
    """
    first = interleaved(candidates, warmup=2, repeats=repeats)
    second = interleaved(dict(reversed(candidates.items())), warmup=1, repeats=repeats)
    return {
        name: Timing(
            median_s=(first[name].median_s + second[name].median_s) / 2,
            min_s=min(first[name].min_s, second[name].min_s),
            max_s=max(first[name].max_s, second[name].max_s),
            repeats=first[name].repeats + second[name].repeats,
        )
        for name in candidates
    }


def run(quick: bool = False) -> list[dict[str, object]]:
    """Median times of forward and forward+backward, eager and XLA, float32 on the CPU.

    Each row: implementation, pass, mode (``"eager"`` or ``"tf.function(jit_compile=True)"``),
    shape, dtype, device, median_s (the mean of the medians of two interleaved loops, the peers in
    opposite orders), repeats, and ``ratio_to`` mapping the other layer of its group to this
    median / its median (below 1: this one is faster), measured in the same loops.
    """
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            "normkit.tf.bench measures the TensorFlow backend; KERAS_BACKEND is "
            f"{keras.backend.backend()!r}"
        )
    import tensorflow as tf

    shape = (1024, 1024) if quick else (8192, 4096)
    repeats = 5 if quick else 15
    rng = np.random.default_rng(0)
    rows: list[dict[str, object]] = []
    with tf.device("/CPU:0"):
        x = tf.constant(rng.standard_normal(shape, dtype=np.float32))
        dy = tf.constant(rng.standard_normal(shape, dtype=np.float32))
        for group in _peers().values():
            layers = {name: make() for name, make in group.items()}
            for layer in layers.values():
                layer.build(shape)
            for backward in (False, True):
                for jit in (False, True):
                    tasks = {
                        name: _task(layer, x, dy, backward, jit) for name, layer in layers.items()
                    }
                    timings = _both_orders(tasks, repeats)
                    for name, timing in timings.items():
                        row: dict[str, object] = {
                            "implementation": name,
                            "pass": "forward+backward" if backward else "forward",
                            "mode": "tf.function(jit_compile=True)" if jit else "eager",
                            "shape": shape,
                            "dtype": "float32",
                            "device": "cpu",
                            "median_s": timing.median_s,
                            "repeats": timing.repeats,
                            "ratio_to": {
                                peer: timing.median_s / other.median_s
                                for peer, other in timings.items()
                                if peer != name
                            },
                        }
                        rows.append(row)
    return rows


def _table(rows: list[dict[str, object]]) -> str:
    lines = [f"{'implementation':34} {'pass':17} {'mode':30} {'median ms':>10}  ratio to peer"]
    for row in rows:
        ratio_to: dict[str, float] = row["ratio_to"]  # type: ignore[assignment]
        ratios = ", ".join(f"{v:.2f} x {peer}" for peer, v in ratio_to.items())
        lines.append(
            f"{row['implementation']:34} {row['pass']:17} {row['mode']:30} "
            f"{1e3 * float(row['median_s']):10.1f}  {ratios}"  # type: ignore[arg-type]
        )
    shape, dtype, device = rows[0]["shape"], rows[0]["dtype"], rows[0]["device"]
    return f"shape {shape}, {dtype}, {device}\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small shape and few repeats")
    print(_table(run(quick=parser.parse_args(argv).quick)))


if __name__ == "__main__":
    main()
