"""normkit.bench.targets and runs: the verdicts come from the rows' ratios, fractions and host
times; several runs are judged on the median of their values, and a parity target is decided by
three full runs; ``normkit bench --combine`` reads runs' JSON files as one."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from normkit.bench import cli, runs, targets
from normkit.bench.core import HIDDEN, TOKEN_SHAPE

KERAS = "keras.layers.RMSNormalization"


def row(implementation: str, hidden: int, ratio: float, **fields: Any) -> dict[str, Any]:
    """A normkit row of Keras' eager RMSNorm group on the CPU (a parity target), latency."""
    base = {
        "implementation": implementation, "role": "normkit", "backend": "tf", "device": "cpu",
        "pass": "forward", "mode": "eager", "timing": "latency", "memory": "as allocated",
        "shape": [2**25 // hidden, hidden], "dtype": "float32", "median_s": 0.01, "min_s": 0.009,
        "max_s": 0.012, "repeats": 8, "host_s": 0.01, "gb_per_s": 1.0,
        "fraction_of_copy_floor": 0.5, "ratios": {KERAS: ratio},
    }
    base.update(fields)
    return base


def run_of(ratios: tuple[float, float, float], **fields: Any) -> dict[str, Any]:
    return {"normkit": "0", "quick": False, "seconds": 1.0, "versions": {}, "rows": [
        row("normkit.tf.RMSNorm", h, r, **fields) for h, r in zip(HIDDEN, ratios, strict=True)]}


def parity(verdicts: list[targets.Verdict]) -> targets.Verdict:
    (found,) = [v for v in verdicts if v.target.name.startswith(
        "Keras/TF eager float32 forward: `normkit.tf.RMSNorm`")]
    return found


def test_a_parity_target_is_met_at_095x_in_the_median_of_three_full_runs() -> None:
    three = [run_of((0.90, 0.99, 1.02)), run_of((0.97, 0.93, 0.96)), run_of((1.00, 0.96, 0.94))]
    verdict = parity(targets.judge([runs.as_run(r) for r in three]))
    assert verdict.target.bound == 0.95 and verdict.target.runs == 3
    assert verdict.values == {1024: pytest.approx(0.97), 4096: pytest.approx(0.96),
                              16384: pytest.approx(0.96)}
    assert verdict.met and verdict.final and verdict.verdict == "met"
    # each run alone would have failed it
    for alone in three:
        single = parity(targets.judge([runs.as_run(alone)]))
        assert not single.met and not single.final
        assert single.verdict == "not met in 1 of 3 runs"


def test_a_size_no_run_measured_fails_a_full_runs_target() -> None:
    data = run_of((1.2, 1.2, 1.2))
    data["rows"] = data["rows"][:2]
    verdict = parity(targets.judge([runs.as_run(data)]))
    assert verdict.values[16384] is None and not verdict.met
    assert "16384: -" in verdict.cells()


def test_targets_of_a_backend_the_runs_did_not_measure_are_left_out() -> None:
    verdicts = targets.judge([runs.as_run(run_of((1.0, 1.0, 1.0)))])
    assert {v.target.where["backend"] for v in verdicts} == {"tf"}
    assert all(v.target.where["mode"] == "eager" for v in verdicts)


def test_a_quick_run_is_judged_at_its_own_sizes_and_never_decides() -> None:
    quick = {"quick": True, "rows": [row("normkit.tf.RMSNorm", 4096, 0.99)]}
    verdict = parity(targets.judge([runs.as_run(quick)]))
    assert verdict.values == {4096: 0.99} and verdict.met and not verdict.final
    assert verdict.verdict == "met (quick run)"
    with pytest.raises(ValueError, match="quick and full runs"):
        targets.judge([runs.as_run(quick), runs.as_run(run_of((1.0, 1.0, 1.0)))])


def test_the_host_time_target_reads_normkits_and_torchs_host_time_at_one_token() -> None:
    def host(implementation: str, host_s: float) -> dict[str, Any]:
        return row(implementation, 4096, 1.0, backend="torch", shape=list(TOKEN_SHAPE),
                   timing="throughput", host_s=host_s, role="normkit" if "normkit" in
                   implementation else "peer", ratios={})

    rows = [host("normkit.torch.RMSNorm", 20e-6), host("torch.nn.RMSNorm", 8e-6)]
    (verdict,) = [v for v in targets.judge([targets.Run(rows)]) if v.target.measure == "host"]
    assert verdict.values == {4096: pytest.approx(2.5)} and not verdict.met
    assert verdict.cells() == "1x4096: 2.50x" and verdict.target.at_most


def test_rows_written_before_the_timings_read_as_latency() -> None:
    old = run_of((1.0, 1.0, 1.0))
    for r in old["rows"]:
        del r["timing"], r["max_s"], r["host_s"]
    assert parity(targets.judge([runs.as_run(old)])).met
    merged = runs.merge([old, run_of((0.5, 0.5, 0.5))])
    assert {r["timing"] for r in merged["rows"]} == {"latency"} and len(merged["rows"]) == 3


def test_merge_takes_each_figures_median_and_the_whole_spread() -> None:
    three = [run_of((r, r, r), median_s=m, min_s=m / 2, max_s=m * 2)
             for r, m in ((0.9, 1.0), (1.1, 3.0), (1.0, 2.0))]
    merged = runs.merge(three)
    assert merged["runs"] == 3 and len(merged["rows"]) == 3
    first = merged["rows"][0]
    assert first["median_s"] == 2.0 and first["min_s"] == 0.5 and first["max_s"] == 6.0
    assert first["ratios"] == {KERAS: 1.0} and first["repeats"] == 24


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="normkit bench")
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_combine_judges_the_runs_files_as_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                              ) -> None:
    paths = []
    for i, ratios in enumerate(((0.90, 0.99, 1.02), (0.97, 0.93, 0.96), (1.00, 0.96, 0.94))):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run_of(ratios)))
    out = tmp_path / "combined.json"
    status = cli.run(_args("--combine", *map(str, paths), "--json", str(out)))
    printed = capsys.readouterr().out
    assert status == 0
    assert printed.startswith("normkit 0 bench, 3 runs combined (each figure their median)")
    assert re.search(r"\n    met +RMSNorm +float32 +forward +>= 0\.95x +0\.97x +0\.96x +0\.96x\n",
                     printed)
    data = json.loads(out.read_text())
    (verdict,) = [t for t in data["targets"] if t["target"].startswith("Keras/TF eager float32 "
                                                                      "forward: `normkit.tf.RMS")]
    assert verdict["met"] and verdict["final"] and verdict["runs"] == 3
    assert verdict["values"] == {"1024": 0.97, "4096": 0.96, "16384": 0.96}


def test_combine_refuses_run_options_and_files_that_are_no_bench_run(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(run_of((1.0, 1.0, 1.0))))
    bad.write_text(json.dumps({"cases": []}))
    for argv, message in (
        (["--combine", str(good), "--quick"], "--combine reads runs and measures nothing: drop "
                                              "--quick"),
        (["--combine", str(good), str(bad)], f"{bad}: not a normkit bench file (no list of "
                                             "'rows')"),
    ):
        done = subprocess.run([sys.executable, "-m", "normkit", "bench", *argv],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2
        assert done.stderr.strip() == f"normkit bench: error: {message}"


def test_the_summary_explains_the_huge_pages_view_where_it_shows_it() -> None:
    from normkit.bench import summary
    from normkit.bench.core import MEMORY_NOTE

    def pair(memory: str, timing: str) -> list[dict[str, Any]]:
        ours = row("normkit.torch.RMSNorm", 4096, 2.0, backend="torch", memory=memory,
                   timing=timing, ratios={"torch.nn.RMSNorm": 2.0})
        theirs = row("torch.nn.RMSNorm", 4096, 0.5, backend="torch", memory=memory,
                     timing=timing, role="peer", ratios={"normkit.torch.RMSNorm": 0.5})
        return [ours, theirs]

    rows = [r for m in ("as allocated", "on huge pages") for t in ("latency", "throughput")
            for r in pair(m, t)]
    data = {"normkit": "0", "quick": False, "seconds": 2.0, "versions": {}, "rows": rows,
            "machine": {"cpus": 2, "load_average": [0.2, 1.7]}}
    text = summary.summary(data, targets.judge([runs.as_run(data)]))
    lines = text.splitlines()
    assert all(len(line) <= 100 and line == line.rstrip() for line in lines)
    assert " ".join(line.strip() for line in lines[:2]).startswith(
        "normkit 0 bench: 2 s on 2 CPUs, load average 0.2 at the start and 1.7 at the end (other "
        "work shared the cores")
    assert "  torch on cpu, eager, float32, outputs on huge pages" in lines
    joined = " ".join(line.strip() for line in lines)
    assert MEMORY_NOTE in joined
    found = [i for i, x in enumerate(lines) if x.startswith("    RMSNorm vs torch.nn.RMSNorm")]
    assert len(found) == 2  # a panel per memory view
    for i in found:
        line, head = lines[i], lines[i - 1]
        for column in ("latency", "throughput"):  # each value ends under its heading
            end = head.index(column) + len(column)
            assert line[end - 4:end] == "2.00"
