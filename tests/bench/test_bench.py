"""normkit bench: the quick CLI run prints its summary first and writes every row with every field
in both timings, a readable PNG; the huge-pages view; the estimate of the time left over the whole
run; skips and failures.

No timing assertions: the speed targets live in the benchmark (docs/benchmarks.md), never here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import normkit.bench
from normkit import backends, workers
from normkit.bench import cli, report
from normkit.bench.core import (
    FIELDS,
    MEMORY_NOTE,
    PASSES,
    QUICK_TOKEN_ROUNDS,
    ROLES,
    THROUGHPUT_CALLS,
    TIMINGS,
    TOKEN_SHAPE,
    Group,
    Sweep,
    bytes_moved,
    time_group,
)
from normkit.progress import Progress

PEERS = {
    "torch": {"normkit.torch.RMSNorm", "torch.nn.RMSNorm", "Llama RMSNorm (torch ops)", "normkit.torch.LayerNorm", "torch.nn.LayerNorm"},
    "tf": {"normkit.tf.RMSNorm", "keras.layers.RMSNormalization", "normkit.tf.LayerNorm", "keras.layers.LayerNormalization"},
    "jax": {
        "normkit.jax.RMSNorm", "normkit.jax.nnx.RMSNorm", "flax.linen.RMSNorm",
        "normkit.jax.LayerNorm", "normkit.jax.nnx.LayerNorm", "flax.linen.LayerNorm",
    },
}
INSTALLED = [b.name for b in backends.BACKENDS if not b.missing()]
KERAS_ON_JAX = "tf" in INSTALLED and importlib.util.find_spec("jax") is not None
"""normkit.tf is timed again on Keras' JAX backend (its modes: JAX eager, jax.jit)."""
MODES = {
    "torch": {"eager", "torch.compile"},
    "tf": {"eager", "tf.function(jit_compile=True)"} | ({"JAX eager", "jax.jit"} if KERAS_ON_JAX else set()),
    "jax": {"jax.jit"},
}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="normkit bench", description=cli.HELP)
    cli.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``normkit bench --quick --json out.json --plot out.png`` on the CPU, once for this module,
    with what it printed."""
    out = tmp_path_factory.mktemp("bench")
    start = time.perf_counter()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli.run(_args("--quick", "--device", "cpu", "--json", str(out / "out.json"), "--plot", str(out / "out.png")))
    return {
        "status": status,
        "seconds": time.perf_counter() - start,
        "data": json.loads((out / "out.json").read_text()),
        "png": out / "out.png",
        "printed": printed.getvalue(),
    }


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """The rows by group and timing (the rows compared with one another)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["backend"], row["device"], row["pass"], row["mode"], row["memory"], tuple(row["shape"]), row["dtype"], row["timing"])
        groups.setdefault(key, []).append(row)
    return groups


def test_quick_run_covers_every_installed_backend_peer_pass_and_dtype(quick: dict[str, Any]) -> None:
    data = quick["data"]
    assert quick["status"] == 0 and data["errors"] == {}
    print(f"normkit bench --quick: {quick['seconds']:.0f} s")
    assert sorted(data["versions"]) == sorted(INSTALLED)
    views = {"torch [on huge pages]"} if "torch" in INSTALLED else set()  # not with --quick
    views |= {"tf [Keras on JAX]"} if "tf" in INSTALLED and not KERAS_ON_JAX else set()
    assert sorted(data["skipped"]) == sorted(set(PEERS) - set(INSTALLED) | views)
    sweep = Sweep.make(quick=True)
    for backend in INSTALLED:
        rows = [r for r in data["rows"] if r["backend"] == backend]
        assert PEERS[backend] <= {r["implementation"] for r in rows}
        assert {r["mode"] for r in rows} == MODES[backend]
        assert {(r["pass"], r["dtype"], r["timing"]) for r in rows} == {(p, "float32", t) for p in PASSES for t in TIMINGS}
        assert {r["shape"][1] for r in rows} == set(sweep.hidden)
        token = [r for r in rows if tuple(r["shape"]) == TOKEN_SHAPE]
        assert {(r["pass"], r["timing"]) for r in token} == {(p, t) for p in PASSES for t in TIMINGS}
        for row in token:
            latency = row["timing"] == "latency"
            assert row["repeats"] == (QUICK_TOKEN_ROUNDS if latency else sweep.token_throughput_repeats)
            assert row["calls"] == (1 if latency else THROUGHPUT_CALLS)
    torch_compiled = {tuple(r["shape"]) + (r["dtype"], r["pass"]) for r in data["rows"] if r["mode"] == "torch.compile"}
    assert len(torch_compiled) <= 1  # --quick: one compiled pair
    assert {row["memory"] for row in data["rows"]} == {"as allocated"}


TINY = dataclasses.replace(
    Sweep.make(), hidden=(1024,), elements=8192, warmup=1, repeats=1, token_rounds=2,
    throughput_repeats=1, token_throughput_repeats=1, dtypes=("float32",), devices=("cpu",),
    modes=("eager",),
)
"""A sweep of a few seconds: one hidden size and one token, eager, float32, one sample each."""


@pytest.mark.skipif("torch" not in INSTALLED, reason="torch is not installed")
def test_torch_on_the_cpu_is_timed_again_with_every_output_on_huge_pages() -> None:
    """The huge-pages view times the same groups as the default view, in a worker whose torch
    allocates on huge pages (the worker refuses to run that view without the environment)."""
    if normkit.bench._huge_pages_unavailable():
        pytest.skip(normkit.bench._huge_pages_unavailable())
    torch_backend = backends.get("torch")
    report = normkit.bench.Report()
    view = normkit.bench._huge_pages_view(torch_backend, TINY, report)
    assert [job.label for job in view] == ["torch [on huge pages]"] and not report.skipped
    jobs = [normkit.bench._Job(torch_backend, TINY, "torch"), *view]
    eta = normkit.bench._Eta(jobs, None)
    for job in jobs:
        normkit.bench._work(job, report, eta)
    assert report.errors == {}
    views: dict[str, set[tuple[Any, ...]]] = {"as allocated": set(), "on huge pages": set()}
    for key, rows in _groups(report.rows).items():
        views[key[4]].add(key[:4] + key[5:])
        assert {r["implementation"] for r in rows} >= {"normkit.torch.RMSNorm", "torch.nn.RMSNorm", "copy (clone)"}
    assert views["on huge pages"] == views["as allocated"] != set()


def test_the_quick_sweep_skips_the_huge_pages_view_saying_why() -> None:
    report = normkit.bench.Report()
    assert normkit.bench._huge_pages_view(backends.get("torch"), Sweep.make(quick=True), report) == []
    assert report.skipped == {"torch [on huge pages]": f"not with --quick ({MEMORY_NOTE})"}


def test_the_huge_pages_view_refuses_to_run_without_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from normkit.bench import worker

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    sweep = dataclasses.replace(Sweep.make(quick=True), memory="on huge pages")
    with pytest.raises(RuntimeError, match="THP_MEM_ALLOC_ENABLE"):
        worker.run_job({"backend": "torch", "sweep": normkit.bench.sweep_to_dict(sweep)}, lambda event: None)


def test_every_row_has_every_field_and_consistent_figures(quick: dict[str, Any]) -> None:
    sweep = Sweep.make(quick=True)
    groups = _groups(quick["data"]["rows"])
    for key, rows in groups.items():
        assert Counter(r["role"] for r in rows)["copy floor"] == 1, key
        (floor,) = [r for r in rows if r["role"] == "copy floor"]
        named = {r["implementation"] for r in rows if r["role"] != "copy floor"}
        latency = {r["implementation"]: r for r in groups[key[:-1] + ("latency",)]}
        for row in rows:
            assert tuple(row) == FIELDS
            assert row["role"] in ROLES and row["pass"] in PASSES and row["timing"] in TIMINGS
            assert row["role"] != "normkit" or row["implementation"].startswith("normkit.")
            assert len(row["shape"]) == 2 and all(isinstance(n, int) and n > 0 for n in row["shape"])
            assert 0 < row["min_s"] <= row["median_s"] <= row["max_s"] and row["repeats"] >= 3
            # On the CPU every call computes before it returns: its host time is all of it.
            assert 0 < row["host_s"] <= row["median_s"]
            # A throughput sample holds as many calls as the sweep gives a call of the
            # latency median measured just before it (50 at one token).
            expected = sweep.calls(row["device"], row["shape"], latency[row["implementation"]]["median_s"])
            assert row["calls"] == (1 if row["timing"] == "latency" else expected)
            assert row["bytes_moved"] == bytes_moved(row["shape"], row["dtype"], row["pass"])
            assert row["gb_per_s"] == pytest.approx(row["bytes_moved"] / row["median_s"] / 1e9)
            assert row["fraction_of_copy_floor"] == pytest.approx(floor["median_s"] / row["median_s"])
            if row["role"] == "copy floor":
                assert row["ratios"] == {}
            else:
                assert set(row["ratios"]) == named - {row["implementation"]}
                by_name = {r["implementation"]: r for r in rows}
                for peer, ratio in row["ratios"].items():
                    assert ratio == pytest.approx(by_name[peer]["median_s"] / row["median_s"])
            assert row["peak_memory_bytes"] is None  # CPU: no backend reports it
            saved = row["saved_for_backward_bytes"]
            torch_eager_backward = (row["backend"], row["mode"], row["pass"]) == ("torch", "eager", "forward+backward")
            if torch_eager_backward and row["role"] != "copy floor":
                rows_n, hidden = row["shape"]
                assert isinstance(saved, int) and saved >= rows_n * hidden * (4 if row["dtype"] == "float32" else 2)
            else:
                assert saved is None


def test_plot_is_a_readable_png(quick: dict[str, Any]) -> None:
    import matplotlib.image

    png: Path = quick["png"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] >= 300 and image.shape[1] >= 600
    assert image[..., :3].std() > 0.05  # not blank


def test_table_has_a_line_per_row(quick: dict[str, Any]) -> None:
    rows = quick["data"]["rows"]
    text = report.table(rows)
    assert sum(line.startswith("  ") for line in text.splitlines()) == len(rows) + len(_groups(rows))


def test_the_tables_columns_line_up_under_their_headers(quick: dict[str, Any]) -> None:
    """Each right-aligned column ends where its header ends, in every line of every group."""
    lines = report.table(quick["data"]["rows"]).splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("  implementation")]
    assert heads
    for i in heads:
        head = lines[i]
        ends = [head.index(name) + len(name) for name in ("median ms", "min-max ms", "GB/s", "of copy", "host us", "calls")]
        for line in lines[i + 1:]:
            if not line.startswith("  ") or line.startswith("  implementation"):
                break
            for end in ends:
                assert line[end - 1] != " " and (end == len(line) or line[end] == " "), (head, line)


def test_the_summary_comes_first_fits_100_columns_and_explains_its_terms(quick: dict[str, Any]) -> None:
    printed = quick["printed"]
    lines = printed.splitlines()
    assert lines[0].startswith("normkit ") and " bench --quick: " in lines[0]
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    rows, hidden = Sweep.make(quick=True).shapes()[0]
    order = [printed.index(title) for title in (f"\nSpeed at {rows} x {hidden}: ", "\nOne token (1 x 4096): ", "\nTargets (docs/benchmarks.md): ", "\nTerms\n")]
    assert order == sorted(order)
    terms = printed[printed.index("\nTerms\n"):]
    for term in ("latency: ", "throughput: ", "ratio: ", "host time: "):
        assert f"\n  {term}" in terms
    # every heading names the timings it shows, and the per-row table waits for --table
    assert "latency throughput" in printed and "\n  implementation" not in printed
    assert lines[-1].endswith("every row: --table, every field: --json PATH")
    assert all(line == line.rstrip() for line in lines)


def test_bytes_moved_and_the_copy_of_the_same_bytes() -> None:
    assert bytes_moved((8, 1024), "float32", "forward") == 2 * 8 * 1024 * 4
    assert bytes_moved((8, 1024), "bfloat16", "forward+backward") == 5 * 8 * 1024 * 2
    group = Group("torch", "cpu", "forward+backward", "eager", (8, 1024), "float32")
    assert 2 * group.copy_elements * 4 == group.bytes_moved


def test_sweep_defaults_and_dtype_errors() -> None:
    sweep = Sweep.make()
    assert sweep.hidden[0] == 1024 and sweep.hidden[-1] == 16384
    *swept, token = sweep.shapes()
    assert [hidden for _, hidden in swept] == list(sweep.hidden)
    assert all(abs(rows * hidden - 32 * 2**20) < hidden for rows, hidden in swept)
    assert token == TOKEN_SHAPE == (1, 4096)
    assert sweep.dtypes_on("cpu") == ("float32", "bfloat16")
    assert sweep.dtypes_on("cuda:0") == ("float32", "bfloat16", "float16")
    assert sweep.select(["cpu", "cuda:0"]) == ["cpu", "cuda:0"]
    assert Sweep.make(devices=["cuda:0"]).select(["cpu"]) == []
    assert sweep.timings == TIMINGS and Sweep.make(timings=["throughput"]).timings == ("throughput",)
    assert Sweep.make(quick=True).dtypes_on("cpu") == ("float32",)
    assert Sweep.make(quick=True, dtypes=["bfloat16"]).dtypes_on("cpu") == ("bfloat16",)
    with pytest.raises(ValueError, match=r"dtype 'int8' is not one of"):
        Sweep.make(dtypes=["int8"])
    with pytest.raises(ValueError, match=r"timing 'fast' is not one of"):
        Sweep.make(timings=["fast"])
    with pytest.raises(ValueError, match=r"mode 'lazy' is not one of"):
        Sweep.make(modes=["lazy"])


def test_throughput_calls_per_sample() -> None:
    """50 calls a sample on an accelerator and at one token; on the CPU's swept shapes as many as
    fill the sweep's sample time, at least 2 and at most 50."""
    sweep, quick_ = Sweep.make(), Sweep.make(quick=True)
    assert sweep.calls("cuda:0", (8192, 4096), 0.5) == sweep.calls("cpu", TOKEN_SHAPE, 0.01) == 50
    assert sweep.calls("cpu", (8192, 4096), 0.01) == 5 and quick_.calls("cpu", (256, 4096), 0.01) == 2
    assert sweep.calls("cpu", (8192, 4096), 0.5) == 2 and sweep.calls("cpu", (8192, 4096), 1e-5) == 50


@pytest.mark.parametrize("empty", ["backends", "devices", "dtypes", "timings", "modes"])
def test_an_empty_selection_is_refused_not_read_as_all(empty: str) -> None:
    with pytest.raises(ValueError, match=rf"{empty}=\[\] selects nothing"):
        normkit.bench.run(**{empty: []}, progress=False)


@pytest.mark.skipif(not KERAS_ON_JAX, reason="needs keras, tensorflow and jax")
def test_normkit_tf_is_timed_again_on_kerass_jax_backend(quick: dict[str, Any]) -> None:
    """A second tf worker under KERAS_BACKEND=jax times the same layers over the same groups,
    eager and jitted, each beside a jitted copy; its versions join tf's."""
    groups = _groups([r for r in quick["data"]["rows"] if r["backend"] == "tf"])
    on_jax = {"JAX eager", "jax.jit"}
    by_mode: dict[str, set[tuple[Any, ...]]] = {}
    for key, rows in groups.items():
        by_mode.setdefault(key[3], set()).add(key[:3] + key[4:])
        copy = "copy (jnp.copy)" if key[3] in on_jax else "copy (x * 1)"
        assert {r["implementation"] for r in rows} == PEERS["tf"] | {copy}
    assert set(by_mode) == MODES["tf"]
    assert all(cells == by_mode["eager"] for cells in by_mode.values())
    assert {"tensorflow", "keras", "jax"} <= set(quick["data"]["versions"]["tf"])


def test_an_alternative_framework_not_installed_is_skipped_naming_its_packages() -> None:
    absent = backends.Alternative(("no_such_package_nk",), {"KERAS_BACKEND": "jax"}, "Keras on JAX")
    tf_backend = dataclasses.replace(backends.get("tf"), alternatives=(absent,))
    report = normkit.bench.Report()
    assert normkit.bench._alternatives(tf_backend, Sweep.make(quick=True), report) == []
    assert report.rows == [] and report.errors == {}
    assert report.skipped == {"tf [Keras on JAX]": "no_such_package_nk not installed"}


def test_kerass_jax_backend_is_timed_where_tensorflow_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with Keras and JAX but no TensorFlow (the GPU machine) still times normkit.tf,
    on Keras' JAX backend; TensorFlow's own run is skipped with its install command."""
    present = backends.Alternative((), {"KERAS_BACKEND": "jax"}, "Keras on JAX")
    no_tensorflow = dataclasses.replace(
        backends.get("tf"), packages=("no_such_package_nk", "keras"), alternatives=(present,)
    )
    monkeypatch.setattr(backends, "BACKENDS", (no_tensorflow,))
    worked: list[tuple[str, dict[str, str], str]] = []

    def work(job: normkit.bench._Job, report_: normkit.bench.Report, eta: Any) -> None:
        worked.append((job.backend.name, dict(job.env), job.label))

    monkeypatch.setattr(normkit.bench, "_work", work)
    result = normkit.bench.run(quick=True, progress=False)
    assert worked == [("tf", {"KERAS_BACKEND": "jax"}, "tf [Keras on JAX]")]
    assert result.skipped == {"tf": "no_such_package_nk not installed: pip install 'normkit[tf]'"}


def test_missing_backend_is_skipped_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    absent = backends.Backend("torch", "normkit.torch", "torch", ("no_such_package_nk",), "TorchBridge")
    monkeypatch.setattr(backends, "BACKENDS", (absent,))
    result = normkit.bench.run(quick=True, progress=False)
    assert result.rows == [] and result.errors == {}
    assert result.skipped == {"torch": "no_such_package_nk not installed: pip install 'normkit[torch]'"}


@pytest.mark.skipif("tf" not in INSTALLED, reason="needs tensorflow and keras")
def test_a_failing_worker_is_reported_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    numpy_keras = dataclasses.replace(backends.get("tf"), env={"KERAS_BACKEND": "numpy"}, alternatives=())
    monkeypatch.setattr(backends, "BACKENDS", (numpy_keras,))
    result = normkit.bench.run(backends=["tf"], quick=True, progress=False)
    assert result.rows == []
    assert "measures Keras' backends ['tensorflow', 'jax']; KERAS_BACKEND is 'numpy'" in result.errors["tf"]


@pytest.mark.skipif("jax" not in INSTALLED, reason="needs jax and flax")
def test_a_device_the_backend_lacks_is_skipped_naming_those_it_sees() -> None:
    result = normkit.bench.run(backends=["jax"], devices=["gpu:7"], quick=True, progress=False)
    assert result.rows == [] and result.errors == {}
    assert result.skipped["jax"].startswith("no device of ['cuda:7'] (it sees ['cpu'")


@pytest.mark.skipif("jax" not in INSTALLED, reason="needs jax and flax")
def test_a_backend_that_runs_none_of_the_modes_asked_for_is_skipped_saying_so() -> None:
    result = normkit.bench.run(backends=["jax"], modes=["eager"], quick=True, progress=False)
    assert result.rows == [] and result.errors == {}
    assert result.skipped["jax"] == "it runs in none of the modes ['eager']"


def _fake_workers(groups: dict[str, int], fail: str = "") -> Any:
    """`normkit.workers.run` standing in for the bench's workers: each plans ``groups[label]``
    groups and reports them one by one; the backend named ``fail`` fails after its first."""
    def run(module: str, job: dict[str, Any], env: dict[str, str], on_event: Any) -> str:
        name = job["backend"] + (" [Keras on JAX]" if env.get("KERAS_BACKEND") == "jax" else "")
        on_event({"versions": {}, "devices": ["cpu"], "planned": groups[name]})
        for i in range(groups[name]):
            on_event({"group": f"{name} group {i}", "rows": []})
            if job["backend"] == fail:
                return "it broke"
        return ""
    return run


def test_the_estimate_of_the_time_left_covers_the_whole_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The progress holds every worker's expected work from the start: once the first backend is
    done, the work left is the others' (not nothing, as when each worker added its own groups on
    starting); a worker that plans more groups than expected adds them; one that fails takes off
    what it did not do, so that the run ends with nothing left."""
    names = ["torch", "jax"]
    present = [dataclasses.replace(backends.get(n), packages=(), alternatives=()) for n in names]
    monkeypatch.setattr(backends, "BACKENDS", tuple(present))
    monkeypatch.setattr(normkit.bench, "HUGE_PAGE_ENV", {})
    sweep = Sweep.make(quick=True)
    jobs = [normkit.bench._Job(b, sweep, b.name) for b in present]
    for job in jobs:
        job.expect()
    expected = {job.label: (job.groups, job.startup_s + job.groups * job.group_s) for job in jobs}
    bar = Progress("bench", stream=io.StringIO())
    eta = normkit.bench._Eta(jobs, bar)
    assert bar.total == sum(g for g, _ in expected.values())
    assert bar.work == pytest.approx(sum(w for _, w in expected.values()))
    monkeypatch.setattr(workers, "run", _fake_workers({"torch": expected["torch"][0] + 2, "jax": 5}, fail="jax"))
    report = normkit.bench.Report()
    normkit.bench._work(jobs[0], report, eta)
    assert bar.done == expected["torch"][0] + 2
    assert bar.work - bar.work_done == pytest.approx(expected["jax"][1]) and bar.left() > 0
    normkit.bench._work(jobs[1], report, eta)
    assert report.errors == {"jax": "it broke"}
    assert bar.work - bar.work_done == pytest.approx(0) and bar.total == bar.done


def test_importing_normkit_bench_imports_no_framework() -> None:
    code = (
        "import sys, normkit, normkit.bench, normkit.bench.cli, normkit.bench.report\n"
        "print([m for m in ('torch', 'tensorflow', 'keras', 'jax', 'flax', 'matplotlib') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_terminated_run_writes_the_groups_it_measured_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """SIGTERM (a time limit's kill) mid-sweep: the groups measured before it are shown and
    written, the JSON says ``interrupted``, the status is 130, and SIGTERM's handler is put back."""
    names = ["torch", "jax"]
    present = [dataclasses.replace(backends.get(n), packages=(), alternatives=()) for n in names]
    monkeypatch.setattr(backends, "BACKENDS", tuple(present))
    sweep = Sweep.make(True, None, None)

    def work(job: normkit.bench._Job, report_: normkit.bench.Report, *_: Any) -> None:
        if job.backend.name == "jax":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
            raise AssertionError("SIGTERM did not interrupt the run")
        group = Group("torch", "cpu", "forward", "eager", (4, 8), "float32")
        report_.rows += time_group(group, sweep, {"normkit.torch.RMSNorm": lambda: None}, ("copy", lambda: None))

    monkeypatch.setattr(normkit.bench, "_work", work)
    monkeypatch.setattr(normkit.bench, "HUGE_PAGE_ENV", {})

    class Unhandled(Exception):
        pass

    def unhandled(signum: int, frame: Any) -> None:  # what the bench's own handler must replace
        raise Unhandled

    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        status = cli.run(_args("--quick", "--json", str(tmp_path / "out.json")))
        assert signal.getsignal(signal.SIGTERM) is unhandled
    finally:
        signal.signal(signal.SIGTERM, before)
    assert status == 130
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["interrupted"] is True and data["errors"] == {}
    assert [(r["backend"], r["implementation"], r["timing"]) for r in data["rows"]] == [
        ("torch", name, timing) for timing in TIMINGS for name in ("normkit.torch.RMSNorm", "copy")
    ]


def test_a_run_terminated_before_its_first_group_exits_130_with_no_rows(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(backends, "BACKENDS", (dataclasses.replace(backends.get("torch"), packages=()),))
    monkeypatch.setattr(normkit.bench, "HUGE_PAGE_ENV", {})

    def work(*_: Any) -> None:
        raise KeyboardInterrupt  # as SIGTERM's handler raises it

    monkeypatch.setattr(normkit.bench, "_work", work)
    assert cli.run(_args("--quick", "--json", str(tmp_path / "out.json"))) == 130
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["interrupted"] is True and data["rows"] == []
