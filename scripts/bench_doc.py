"""docs/benchmarks.md's tables from one `normkit bench --json` file: the speed targets with their
verdicts, each framework's 8192 x 4096 rows, normkit RMSNorm's fraction of the copy floor over
the whole sweep, and each layer's time per call on one token's row.

Run: .venv/bin/python scripts/bench_doc.py bench.json > tables.md
Ratios are the peer's median over normkit's in the same group (above 1: normkit faster); a
target is met when every hidden size meets it."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

from normkit.bench.core import KERAS_JAX_MODES, TOKEN_SHAPE, short_name, swept

HIDDEN = (1024, 4096, 16384)
TABLE_SHAPE = [8192, 4096]
EQUAL = "on huge pages"
PARTIAL = "normkit.torch.PartialRMSNorm(p=0.0625)"

Row = dict[str, Any]


def _pick(rows: list[Row], **fields: Any) -> dict[int, Row]:
    """The rows matching ``fields``, by hidden size."""
    return {
        r["shape"][1]: r for r in rows if all(r.get(k) == v for k, v in fields.items())
    }


def _target(
    name: str, found: dict[int, Row], value: Callable[[Row], float], bound: float, percent: bool
) -> str | None:
    """One table row (None where the backend did not run); a missing hidden size fails it."""
    if not found:
        return None
    cells, met = [], True
    for hidden in HIDDEN:
        if hidden not in found:
            cells.append(f"{hidden}: -")
            met = False
            continue
        v = value(found[hidden])
        met &= v >= bound
        cells.append(f"{hidden}: {v:.0%}" if percent else f"{hidden}: {v:.2f}x")
    return f"| {name} | {', '.join(cells)} | {'met' if met else '**not met**'} |"


def _ratio(peer: str) -> Callable[[Row], float]:
    return lambda row: float(row["ratios"][peer])


def targets(rows: list[Row]) -> Iterable[str]:
    yield "| target | measured (hidden: value) | verdict |"
    yield "|---|---|---|"
    for line in _target_rows(rows):
        if line is not None:
            yield line


# The modules whose layers are held to each framework's target: Flax's, linen and nnx.
OURS = {"tf": ("normkit.tf",), "jax": ("normkit.jax", "normkit.jax.nnx")}


def _target_rows(rows: list[Row]) -> Iterable[str | None]:
    """Each target's row, None for those whose backend did not run."""
    pairs = {
        "tf": [("RMSNorm", "keras.layers.RMSNormalization"),
               ("LayerNorm", "keras.layers.LayerNormalization")],
        "jax": [("RMSNorm", "flax.linen.RMSNorm"), ("LayerNorm", "flax.linen.LayerNorm")],
    }
    label = {"tf": "Keras/TF", "jax": "Flax"}
    for backend, layers in pairs.items():
        modes = sorted({r["mode"] for r in rows if r["backend"] == backend})
        for mode in modes:
            for dtype in ("float32", "bfloat16"):
                for pass_ in ("forward", "forward+backward"):
                    for layer, peer in layers:
                        for ours in (f"{module}.{layer}" for module in OURS[backend]):
                            found = _pick(rows, backend=backend, mode=mode, dtype=dtype,
                                          implementation=ours, **{"pass": pass_})
                            where = "Keras/JAX" if mode in KERAS_JAX_MODES and (
                                backend == "tf") else label[backend]
                            name = f"{where} {mode} {dtype} {pass_}: `{ours}` >= 1.0x `{peer}`"
                            yield _target(name, found, _ratio(peer), 1.0, False)
    torch_eager = dict(backend="torch", mode="eager", memory=EQUAL)
    floors = [("float32", "forward", 0.90), ("float32", "forward+backward", 0.80),
              ("bfloat16", "forward", 0.85)]
    for dtype, pass_, bound in floors:
        found = _pick(rows, implementation="normkit.torch.RMSNorm", dtype=dtype,
                      **torch_eager, **{"pass": pass_})
        yield _target(f"torch CPU, equal memory: {dtype} RMSNorm {pass_} >= {bound:.0%} of "
                      "the copy floor", found, lambda r: float(r["fraction_of_copy_floor"]),
                      bound, True)
    found = _pick(rows, implementation="normkit.torch.RMSNorm", dtype="float32",
                  **torch_eager, **{"pass": "forward"})
    yield _target("torch CPU, equal memory: float32 RMSNorm forward >= 1.1x "
                  "`torch.nn.LayerNorm`", found, _ratio("torch.nn.LayerNorm"), 1.1, False)
    for pass_ in ("forward", "forward+backward"):
        found = _pick(rows, implementation="normkit.torch.LayerNorm", dtype="bfloat16",
                      **torch_eager, **{"pass": pass_})
        yield _target(f"torch CPU, equal memory: bfloat16 LayerNorm {pass_} >= 1.0x "
                      "`torch.nn.LayerNorm`", found, _ratio("torch.nn.LayerNorm"), 1.0, False)
    for memory in sorted({r["memory"] for r in rows if r["backend"] == "torch"}):
        for dtype in ("float32", "bfloat16"):
            for pass_ in ("forward", "forward+backward"):
                found = _pick(rows, backend="torch", mode="eager", memory=memory, dtype=dtype,
                              implementation=PARTIAL, **{"pass": pass_})
                yield _target(f"torch CPU ({memory}) {dtype} {pass_}: `PartialRMSNorm` no "
                              "slower than `RMSNorm`", found, _ratio("normkit.torch.RMSNorm"),
                              1.0, False)


def framework_table(rows: list[Row], backend: str) -> Iterable[str]:
    """Each implementation's forward and forward+backward at `TABLE_SHAPE`, as allocated."""
    chosen = [r for r in rows if r["backend"] == backend and r["shape"] == TABLE_SHAPE
              and r["memory"] == "as allocated"]
    yield ("| implementation | mode | dtype | forward ms | GB/s | of copy | fwd+bwd ms | GB/s "
           "| of copy |")
    yield "|---|---|---|---:|---:|---:|---:|---:|---:|"
    seen: list[tuple[str, str, str]] = []
    for r in chosen:
        key = (r["implementation"], r["mode"], r["dtype"])
        if key not in seen:
            seen.append(key)
    for implementation, mode, dtype in seen:
        cells = []
        for pass_ in ("forward", "forward+backward"):
            match = [r for r in chosen if (r["implementation"], r["mode"], r["dtype"], r["pass"])
                     == (implementation, mode, dtype, pass_)]
            if match:
                r = match[0]
                cells += [f"{r['median_s'] * 1e3:.1f}", f"{r['gb_per_s']:.2f}",
                          f"{r['fraction_of_copy_floor']:.0%}"]
            else:
                cells += ["-", "-", "-"]
        name = f"**{implementation}**" if implementation.startswith("normkit.") else implementation
        yield f"| {name} | {mode} | {dtype} | {' | '.join(cells)} |"


def copy_fractions(rows: list[Row]) -> Iterable[str]:
    """normkit RMSNorm's forward as a fraction of the copy floor, every group of the sweep."""
    yield "| backend | mode | outputs | dtype | hidden 1024 | hidden 4096 | hidden 16384 |"
    yield "|---|---|---|---|---:|---:|---:|"
    groups: dict[tuple[str, str, str, str], dict[int, float]] = {}
    for r in rows:
        if r["implementation"].endswith(".RMSNorm") and r["role"] == "normkit" and (
            r["pass"] == "forward"
        ):
            key = (r["backend"], r["mode"], r["memory"], r["dtype"])
            groups.setdefault(key, {})[r["shape"][1]] = r["fraction_of_copy_floor"]
    for (backend, mode, memory, dtype), by_hidden in groups.items():
        cells = " | ".join(f"{by_hidden[h]:.0%}" if h in by_hidden else "-" for h in HIDDEN)
        yield f"| {backend} | {mode} | {memory} | {dtype} | {cells} |"


PEERS = {
    "torch": ("torch.nn.RMSNorm", "torch.nn.LayerNorm"),
    "tf": ("keras.layers.RMSNormalization", "keras.layers.LayerNormalization"),
    "jax": ("flax.linen.RMSNorm", "flax.linen.LayerNorm"),
}


def token_table(rows: list[Row]) -> Iterable[str]:
    """normkit's RMSNorm and LayerNorm against the framework's own on `TOKEN_SHAPE`, as
    allocated: microseconds per call, where host work decides."""
    yield ("| backend | mode | dtype | pass | layer | normkit us | framework's us | framework / "
           "normkit |")
    yield "|---|---|---|---|---|---:|---:|---:|"
    for r in rows:
        if (tuple(r["shape"]) != TOKEN_SHAPE or r["role"] != "normkit"
                or r["memory"] != "as allocated" or r["backend"] not in PEERS):
            continue
        layer = short_name(r["implementation"], r["backend"])  # "RMSNorm", "nnx.RMSNorm"
        if layer.rsplit(".", 1)[-1] not in ("RMSNorm", "LayerNorm"):
            continue
        peer = PEERS[r["backend"]][layer.endswith("LayerNorm")]
        if peer not in r["ratios"]:
            continue
        ratio = float(r["ratios"][peer])
        yield (f"| {r['backend']} | {r['mode']} | {r['dtype']} | {r['pass']} | {layer} | "
               f"{r['median_s'] * 1e6:.0f} | {r['median_s'] * ratio * 1e6:.0f} | {ratio:.2f}x |")


def main(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    rows = swept(data["rows"])
    sections = [("Targets", targets(rows))]
    ran = {r["backend"] for r in rows}
    sections += [(f"{b} ({' x '.join(map(str, TABLE_SHAPE))})", framework_table(rows, b))
                 for b in ("torch", "tf", "jax") if b in ran]
    sections.append(("RMSNorm forward against the copy floor", copy_fractions(rows)))
    sections.append((f"One token ({' x '.join(map(str, TOKEN_SHAPE))}): time per call",
                     token_table(data["rows"])))
    total = len(data["rows"])
    print(f"<!-- {data['seconds']:.0f} s, {total} rows, versions {data['versions']} -->")
    for title, lines in sections:
        print(f"\n### {title}\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
