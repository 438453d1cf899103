"""scripts/bench_doc.py: the verdicts docs/benchmarks.md states come from the rows' ratios and
fractions, a target met only when every hidden size meets it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_doc.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_doc", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(implementation, hidden, ratio, *, backend="tf", mode="eager", pass_="forward",
         dtype="float32", memory="as allocated", fraction=0.5):
    peer = {"tf": "keras.layers.RMSNormalization", "torch": "torch.nn.LayerNorm",
            "jax": "flax.linen.RMSNorm"}[backend]
    return {
        "implementation": implementation, "role": "normkit", "backend": backend,
        "device": "cpu", "pass": pass_, "mode": mode, "memory": memory,
        "shape": [2**25 // hidden, hidden], "dtype": dtype, "median_s": 0.01,
        "gb_per_s": 1.0, "fraction_of_copy_floor": fraction, "ratios": {peer: ratio},
    }


def test_a_target_is_met_only_at_every_hidden_size():
    bench_doc = _load()
    met = [_row("normkit.tf.RMSNorm", h, 1.0) for h in bench_doc.HIDDEN]
    missed = [_row("normkit.tf.RMSNorm", h, r) for h, r in zip(bench_doc.HIDDEN, (1.2, 0.99, 1.5))]
    (line_met,) = [t for t in bench_doc.targets(met) if "RMSNorm" in t]
    (line_missed,) = [t for t in bench_doc.targets(missed) if "RMSNorm" in t]
    assert line_met.endswith("| met |") and "4096: 1.00x" in line_met
    assert line_missed.endswith("| **not met** |") and "4096: 0.99x" in line_missed


def test_flax_targets_hold_linen_and_nnx_each_to_flax_linen():
    bench_doc = _load()
    rows = [_row(name, h, r, backend="jax", mode="jax.jit")
            for h in bench_doc.HIDDEN
            for name, r in (("normkit.jax.RMSNorm", 1.1), ("normkit.jax.nnx.RMSNorm", 0.9))]
    lines = [t for t in bench_doc.targets(rows) if t.startswith("| Flax")]
    assert lines == [
        "| Flax jax.jit float32 forward: `normkit.jax.RMSNorm` >= 1.0x `flax.linen.RMSNorm` | "
        "1024: 1.10x, 4096: 1.10x, 16384: 1.10x | met |",
        "| Flax jax.jit float32 forward: `normkit.jax.nnx.RMSNorm` >= 1.0x `flax.linen.RMSNorm` | "
        "1024: 0.90x, 4096: 0.90x, 16384: 0.90x | **not met** |",
    ]


def test_copy_floor_targets_read_the_equal_memory_view():
    bench_doc = _load()
    rows = [_row("normkit.torch.RMSNorm", h, 1.2, backend="torch", memory=memory, fraction=f)
            for h in bench_doc.HIDDEN
            for memory, f in (("as allocated", 2.0), ("on huge pages", 0.91))]
    lines = list(bench_doc.targets(rows))
    (floor,) = [t for t in lines if "float32 RMSNorm forward >= 90%" in t]
    (ratio,) = [t for t in lines if "1.1x `torch.nn.LayerNorm`" in t]
    assert floor.endswith("| met |") and "1024: 91%" in floor
    assert ratio.endswith("| met |")
    # Backends and targets the run did not measure are left out, not failed.
    assert not [t for t in lines if "Keras" in t or "bfloat16 LayerNorm" in t]


def test_the_script_prints_every_section(tmp_path):
    rows = [_row("normkit.tf.RMSNorm", h, 1.0) for h in (1024, 4096, 16384)]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"seconds": 1.0, "versions": {}, "rows": rows}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True,
                         text=True, check=True).stdout
    assert "### Targets" in out and "### tf (8192 x 4096)" in out and "### torch" not in out
    assert "| **normkit.tf.RMSNorm** | eager | float32 | 10.0 |" in out


def test_the_token_rows_have_their_own_table_and_stay_out_of_the_targets(tmp_path):
    """A row of one token (1 x 4096) is host work: it is tabled per call, in microseconds, and
    does not count as the sweep's hidden 4096 (its 0.50x would fail the target)."""
    token = _row("normkit.tf.RMSNorm", 4096, 0.5)
    token.update(shape=[1, 4096], median_s=40e-6)
    rows = [_row("normkit.tf.RMSNorm", h, 1.0) for h in (1024, 4096, 16384)] + [token]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"seconds": 1.0, "versions": {}, "rows": rows}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True,
                         text=True, check=True).stdout
    (target,) = [line for line in out.splitlines() if "eager float32 forward" in line
                 and "RMSNorm" in line]
    assert target.endswith("| met |"), target
    assert "### One token (1 x 4096): time per call" in out
    assert "| tf | eager | float32 | forward | RMSNorm | 40 | 20 | 0.50x |" in out
