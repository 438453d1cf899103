"""docs/benchmarks.md's tables from `normkit bench --json` files: the speed targets with their
verdicts (`normkit.bench.targets`), each framework's 8192 x 4096 rows in both timings, normkit
RMSNorm's fraction of the copy floor over the whole sweep, and each layer's time and host time
per call on one token's row.

Run: .venv/bin/python scripts/bench_doc.py bench.json [bench2.json bench3.json] > tables.md
Several files are read as one run (`normkit.bench.runs.merge`: each figure the median of the
runs), and the targets judged on them (a parity target is decided by the median of three full
runs). Ratios are the peer's median over normkit's in the same group and timing (above 1:
normkit faster); a target is met when every hidden size meets it. Times read
"median (min-max)" over a group's samples."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

from normkit.bench import runs, targets
from normkit.bench.core import AS_ALLOCATED, LATENCY, TIMINGS, TOKEN_SHAPE, short_name, swept

HIDDEN = (1024, 4096, 16384)
TABLE_SHAPE = [8192, 4096]
PASSES = ("forward", "forward+backward")

Row = dict[str, Any]


def _timing(row: Row) -> str:
    return row.get("timing", LATENCY)


def _spread(row: Row, scale: float = 1e3, digits: int = 1) -> str:
    """``"13.7 (13.1-15.2)"``: the median and the samples' range, in ms (``scale`` 1e3)."""
    low, high = row.get("min_s"), row.get("max_s")
    median = f"{row['median_s'] * scale:.{digits}f}"
    if low is None or high is None:
        return median
    return f"{median} ({low * scale:.{digits}f}-{high * scale:.{digits}f})"


def framework_table(rows: list[Row], backend: str, device: str) -> Iterable[str]:
    """Each implementation's forward and forward+backward at `TABLE_SHAPE`, as allocated, per
    mode, dtype and timing."""
    chosen = [r for r in rows if r["backend"] == backend and r["device"] == device
              and r["shape"] == TABLE_SHAPE and r["memory"] == AS_ALLOCATED]
    yield ("| implementation | mode | timing | dtype | forward ms | GB/s | of copy | fwd+bwd ms "
           "| GB/s | of copy |")
    yield "|---|---|---|---|---:|---:|---:|---:|---:|---:|"
    seen = list(dict.fromkeys((r["mode"], r["dtype"], _timing(r), r["implementation"])
                              for r in chosen))
    for mode, dtype, timing, implementation in seen:
        cells = []
        for pass_ in PASSES:
            match = [r for r in chosen if (r["implementation"], r["mode"], r["dtype"], r["pass"],
                                           _timing(r)) == (implementation, mode, dtype, pass_,
                                                           timing)]
            if match:
                r = match[0]
                cells += [_spread(r), f"{r['gb_per_s']:.2f}", f"{r['fraction_of_copy_floor']:.0%}"]
            else:
                cells += ["-", "-", "-"]
        name = f"**{implementation}**" if implementation.startswith("normkit.") else implementation
        yield f"| {name} | {mode} | {timing} | {dtype} | {' | '.join(cells)} |"


def copy_fractions(rows: list[Row]) -> Iterable[str]:
    """normkit RMSNorm's forward as a fraction of the copy floor, every group of the sweep."""
    yield ("| backend | device | mode | timing | outputs | dtype | hidden 1024 | hidden 4096 "
           "| hidden 16384 |")
    yield "|---|---|---|---|---|---|---:|---:|---:|"
    groups: dict[tuple[str, ...], dict[int, float]] = {}
    for r in rows:
        if r["implementation"].endswith(".RMSNorm") and r["role"] == "normkit" and (
            r["pass"] == "forward"
        ):
            key = (r["backend"], r["device"], r["mode"], _timing(r), r["memory"], r["dtype"])
            groups.setdefault(key, {})[r["shape"][1]] = r["fraction_of_copy_floor"]
    for key, by_hidden in groups.items():
        cells = " | ".join(f"{by_hidden[h]:.0%}" if h in by_hidden else "-" for h in HIDDEN)
        yield f"| {' | '.join(key)} | {cells} |"


PEERS = {
    "torch": ("torch.nn.RMSNorm", "torch.nn.LayerNorm"),
    "tf": ("keras.layers.RMSNormalization", "keras.layers.LayerNormalization"),
    "jax": ("flax.linen.RMSNorm", "flax.linen.LayerNorm"),
}


def token_table(rows: list[Row]) -> Iterable[str]:
    """normkit's RMSNorm and LayerNorm against the framework's own on `TOKEN_SHAPE`, as
    allocated: microseconds per call in each timing, and the host's microseconds per call
    (throughput: until the call returns, before the wait)."""
    tokens = [r for r in rows if tuple(r["shape"]) == TOKEN_SHAPE and r["memory"] == AS_ALLOCATED]
    index = {(r["backend"], r["device"], r["mode"], _timing(r), r["dtype"], r["pass"],
              r["implementation"]): r for r in tokens}
    timings = [t for t in TIMINGS if any(_timing(r) == t for r in tokens)]
    head = ["backend", "device", "mode", "dtype", "pass", "layer"]
    for timing in timings:
        head += [f"{timing}: normkit us", "framework's us", "framework / normkit"]
    head += ["host us: normkit", "framework's"]
    yield "| " + " | ".join(head) + " |"
    yield "|" + "---|" * 6 + "---:|" * (len(head) - 6)
    keys = dict.fromkeys(k[:3] + k[4:] for k in index)
    for backend, device, mode, dtype, pass_, implementation in keys:
        layer = short_name(implementation, backend)  # "RMSNorm", "nnx.RMSNorm"
        if backend not in PEERS or not implementation.startswith("normkit.") or (
                layer.rsplit(".", 1)[-1] not in ("RMSNorm", "LayerNorm")):
            continue
        peer = PEERS[backend][layer.endswith("LayerNorm")]
        cells = [backend, device, mode, dtype, pass_, layer]
        for timing in timings:
            ours = index.get((backend, device, mode, timing, dtype, pass_, implementation))
            if ours is None or peer not in ours["ratios"]:
                cells += ["-", "-", "-"]
                continue
            ratio = float(ours["ratios"][peer])
            cells += [f"{ours['median_s'] * 1e6:.0f}", f"{ours['median_s'] * ratio * 1e6:.0f}",
                      f"{ratio:.2f}x"]
        host = timings[-1] if timings else LATENCY
        for name in (implementation, peer):
            row = index.get((backend, device, mode, host, dtype, pass_, name))
            cells.append("-" if row is None or not row.get("host_s")
                         else f"{row['host_s'] * 1e6:.1f}")
        yield "| " + " | ".join(cells) + " |"


def main(paths: Sequence[str]) -> None:
    loaded = [runs.load(path) for path in paths]
    data = runs.merge(loaded)
    rows = swept(data["rows"])
    verdicts = targets.judge([runs.as_run(d) for d in loaded])
    sections = [("Targets", targets.markdown(verdicts))]
    for backend, device in dict.fromkeys((r["backend"], r["device"]) for r in rows):
        sections.append((f"{backend} on {device} ({' x '.join(map(str, TABLE_SHAPE))})",
                         framework_table(rows, backend, device)))
    sections.append(("RMSNorm forward against the copy floor", copy_fractions(rows)))
    sections.append((f"One token ({' x '.join(map(str, TOKEN_SHAPE))}): time per call",
                     token_table(data["rows"])))
    total = len(data["rows"])
    print(f"<!-- {len(loaded)} run(s), {data['seconds']:.0f} s, {total} rows, versions "
          f"{data['versions']} -->")
    for title, lines in sections:
        table = list(lines)
        if len(table) > 2:  # a header and its rule: no row, no section
            print(f"\n### {title}\n")
            print("\n".join(table))


if __name__ == "__main__":
    main(sys.argv[1:])
