"""Move a transformer block's weights torch -> Flax (NNX) -> Keras -> torch; compare the outputs.

The block (``block_torch.py``, ``block_flax.py``, ``block_keras.py``) is pre-norm attention and
a SwiGLU MLP with normkit RMSNorms, then a final normkit LayerNorm, written with the same
attribute names in each framework. The norms move with ``normkit.port.export_norms`` /
``import_norms`` (files keyed by the norms' paths, with their specs); the linears by
transposing torch's ``(out, in)`` weights into the ``(in, out)`` kernels of Flax and Keras.
Each framework's output is measured against a float64 numpy evaluation of the block with
normkit's float32 tolerance; the block back in torch must give bit-identical outputs.

Run from the repository root: ``python examples/transformer_block/port_block.py``.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import block_flax  # noqa: E402
import block_keras  # noqa: E402
import block_torch  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import torch  # noqa: E402
from block_config import Config  # noqa: E402
from flax import nnx  # noqa: E402

from normkit import port, reference, tolerances  # noqa: E402
from normkit.port.keras import named_layers  # noqa: E402

Kernels = dict[str, np.ndarray]  # linear layer path -> (in, out) kernel


def torch_kernels(block: torch.nn.Module) -> Kernels:
    return {p: m.weight.detach().numpy().T for p, m in block.named_modules()
            if isinstance(m, torch.nn.Linear)}


def set_torch_kernels(block: torch.nn.Module, kernels: Kernels) -> None:
    linears = {p: m for p, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
    with torch.no_grad():
        for path, m in _matched(linears, kernels).items():
            m.weight.copy_(torch.from_numpy(np.ascontiguousarray(kernels[path].T)))


def flax_kernels(block: nnx.Module) -> Kernels:
    return {".".join(map(str, p)): np.asarray(m.kernel.get_value())
            for p, m in nnx.iter_modules(block) if isinstance(m, nnx.Linear)}


def set_flax_kernels(block: nnx.Module, kernels: Kernels) -> None:
    linears = {".".join(map(str, p)): m for p, m in nnx.iter_modules(block)
               if isinstance(m, nnx.Linear)}
    for path, m in _matched(linears, kernels).items():
        m.kernel.set_value(jnp.asarray(kernels[path]))


def keras_kernels(block: keras.layers.Layer) -> Kernels:
    return {p: m.kernel.numpy() for p, m in named_layers(block).items()
            if isinstance(m, keras.layers.Dense)}


def set_keras_kernels(block: keras.layers.Layer, kernels: Kernels) -> None:
    linears = {p: m for p, m in named_layers(block).items() if isinstance(m, keras.layers.Dense)}
    for path, m in _matched(linears, kernels).items():
        m.kernel.assign(kernels[path])


def _matched(linears: dict, kernels: Kernels) -> dict:
    if set(linears) != set(kernels):
        raise ValueError(f"the linear layers differ: model {sorted(linears)}, weights {sorted(kernels)}")
    return linears


def numpy_block(x: np.ndarray, c: Config, block: torch.nn.Module) -> np.ndarray:
    """The block in float64 numpy, the norms by `normkit.reference`, with ``block``'s weights."""
    w = {k: v.detach().numpy().astype(np.float64) for k, v in block.state_dict().items()}

    def norm(name: str, spec, h: np.ndarray) -> np.ndarray:
        return reference.normalize(h, spec, w[f"{name}.weight"], w.get(f"{name}.bias"))

    def attention(h: np.ndarray) -> np.ndarray:
        b, t, d = h.shape
        q, k, v = ((h @ w[f"attn.{n}.weight"].T).reshape(b, t, c.heads, -1).transpose(0, 2, 1, 3)
                   for n in ("q_proj", "k_proj", "v_proj"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // c.heads)
        scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        return (weights @ v).transpose(0, 2, 1, 3).reshape(b, t, d) @ w["attn.o_proj.weight"].T

    def mlp(h: np.ndarray) -> np.ndarray:
        gate = h @ w["mlp.gate_proj.weight"].T
        return (gate / (1 + np.exp(-gate)) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T

    h = x.astype(np.float64)
    h = h + attention(norm("input_layernorm", c.rms, h))
    h = h + mlp(norm("post_attention_layernorm", c.rms, h))
    return norm("norm", c.final, h)


class Report(NamedTuple):
    """Each implementation's output on the same input, and its measurement against float64."""

    outputs: dict[str, np.ndarray]
    measurements: dict[str, tolerances.Measurement]


def main(workdir: str | Path | None = None) -> Report:
    """Port the block around the three frameworks (the norms' files in ``workdir``, else a
    temporary directory); print and return how each output compares with float64."""
    c = Config()
    torch.manual_seed(0)
    source = block_torch.Block(c)
    with torch.no_grad():  # norm weights away from their initial ones and zeros
        for name, p in source.named_parameters():
            if "layernorm" in name or name.startswith("norm."):
                p.copy_((0.0 if name.endswith("bias") else 1.0) + 0.2 * torch.randn(p.shape))
    x = np.random.default_rng(0).standard_normal((2, 8, c.dim)).astype(np.float32)

    with tempfile.TemporaryDirectory() as tmp:
        files = Path(workdir or tmp)
        flax = block_flax.Block(c, nnx.Rngs(1))
        port.import_norms(flax, port.export_norms(source, files / "from_torch.safetensors"))
        set_flax_kernels(flax, torch_kernels(source))

        keras_block = block_keras.Block(c)
        keras_block(x)  # creates the weights
        port.import_norms(keras_block, port.export_norms(flax, files / "from_flax.safetensors"))
        set_keras_kernels(keras_block, flax_kernels(flax))

        back = block_torch.Block(c)
        port.import_norms(back, port.export_norms(keras_block, files / "from_keras.safetensors"))
        set_torch_kernels(back, keras_kernels(keras_block))

    with torch.no_grad():
        y_torch = source(torch.from_numpy(x)).numpy()
        y_back = back(torch.from_numpy(x)).numpy()
    outputs = {
        "torch": y_torch,
        "flax (nnx)": np.asarray(flax(jnp.asarray(x))),
        "keras": keras.ops.convert_to_numpy(keras_block(x)),
        "torch, ported back": y_back,
    }
    if y_back.tobytes() != y_torch.tobytes():
        raise AssertionError("the block ported back to torch does not give bit-identical outputs")
    expected = numpy_block(x, c, source)
    report = Report(outputs, {name: tolerances.measure(y, expected) for name, y in outputs.items()})
    for name, m in report.measurements.items():
        print(f"{name:>20}: {m.describe()}")
    return report


if __name__ == "__main__":
    sys.exit(0 if all(m.passed for m in main().measurements.values()) else 1)
