"""normkit.tf against Keras' own layers, side by side, on the TensorFlow backend.

``python -m normkit.tf.bench [--quick]`` prints the table; `run` returns its rows.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from normkit.timing import interleaved
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


def run(quick: bool = False) -> list[dict[str, object]]:
    """Median times of forward and forward+backward, eager and XLA, float32 on the CPU.

    Each row: implementation, pass, mode (``"eager"`` or ``"tf.function(jit_compile=True)"``),
    shape, dtype, device, median_s, and ``ratio_to_<peer>`` (this median / the peer's) for the
    other layer of its group, measured in the same interleaved loop.
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
                    timings = interleaved(tasks, warmup=2, repeats=repeats)
                    for name, timing in timings.items():
                        row: dict[str, object] = {
                            "implementation": name,
                            "pass": "forward+backward" if backward else "forward",
                            "mode": "tf.function(jit_compile=True)" if jit else "eager",
                            "shape": shape,
                            "dtype": "float32",
                            "device": "cpu",
                            "median_s": timing.median_s,
                        }
                        for peer, other in timings.items():
                            if peer != name:
                                row[f"ratio_to_{peer}"] = timing.median_s / other.median_s
                        rows.append(row)
    return rows


def _table(rows: list[dict[str, object]]) -> str:
    lines = [f"{'implementation':34} {'pass':17} {'mode':30} {'median ms':>10}  ratio to peer"]
    for row in rows:
        ratios = ", ".join(
            f"{v:.2f} x {k.removeprefix('ratio_to_')}"
            for k, v in row.items()
            if k.startswith("ratio_to_")
        )
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
