"""normkit bench: the quick CLI run writes every row with every field, a readable PNG; skips and failures.

No timing assertions: the speed targets live in the benchmark (docs/benchmarks.md), never here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
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
from normkit import backends
from normkit.bench import cli, report
from normkit.bench.core import (
    FIELDS,
    PASSES,
    QUICK_TOKEN_ROUNDS,
    ROLES,
    TOKEN_SHAPE,
    Group,
    Sweep,
    bytes_moved,
    time_group,
)

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
    """``normkit bench --quick --json out.json --plot out.png`` on the CPU, once for this module."""
    out = tmp_path_factory.mktemp("bench")
    start = time.perf_counter()
    status = cli.run(_args("--quick", "--device", "cpu", "--json", str(out / "out.json"), "--plot", str(out / "out.png")))
    return {
        "status": status,
        "seconds": time.perf_counter() - start,
        "data": json.loads((out / "out.json").read_text()),
        "png": out / "out.png",
    }


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["backend"], row["device"], row["pass"], row["mode"], row["memory"], tuple(row["shape"]), row["dtype"])
        groups.setdefault(key, []).append(row)
    return groups


def test_quick_run_covers_every_installed_backend_peer_pass_and_dtype(quick: dict[str, Any]) -> None:
    data = quick["data"]
    assert quick["status"] == 0 and data["errors"] == {}
    print(f"normkit bench --quick: {quick['seconds']:.0f} s")
    assert sorted(data["versions"]) == sorted(INSTALLED)
    huge = normkit.bench._huge_pages_unavailable()
    views = {"torch [on huge pages]"} if huge and "torch" in INSTALLED else set()
    views |= {"tf [Keras on JAX]"} if "tf" in INSTALLED and not KERAS_ON_JAX else set()
    assert sorted(data["skipped"]) == sorted(set(PEERS) - set(INSTALLED) | views)
    for backend in INSTALLED:
        rows = [r for r in data["rows"] if r["backend"] == backend]
        assert PEERS[backend] <= {r["implementation"] for r in rows}
        assert {r["mode"] for r in rows} == MODES[backend]
        assert {(r["pass"], r["dtype"]) for r in rows} == {(p, d) for p in PASSES for d in ("float32", "bfloat16")}
        assert {r["shape"][1] for r in rows} == set(Sweep.make(quick=True).hidden)
        token = [r for r in rows if tuple(r["shape"]) == TOKEN_SHAPE]
        assert token and all(r["repeats"] == QUICK_TOKEN_ROUNDS for r in token)
        assert {(r["pass"], r["dtype"]) for r in token} == {(p, d) for p in PASSES for d in ("float32", "bfloat16")}
    torch_compiled = {tuple(r["shape"]) + (r["dtype"], r["pass"]) for r in data["rows"] if r["mode"] == "torch.compile" and r["memory"] == "as allocated"}
    assert len(torch_compiled) <= 1  # --quick: one compiled pair
    for row in data["rows"]:
        assert row["memory"] == "as allocated" or (row["backend"], row["device"], row["memory"]) == ("torch", "cpu", "on huge pages")


@pytest.mark.skipif("torch" not in INSTALLED, reason="torch is not installed")
def test_torch_on_the_cpu_is_timed_again_with_every_output_on_huge_pages(quick: dict[str, Any]) -> None:
    """The huge-pages view times the same groups as the default view, in a worker whose torch
    allocates on huge pages (the worker refuses to run that view without the environment)."""
    if normkit.bench._huge_pages_unavailable():
        pytest.skip(normkit.bench._huge_pages_unavailable())
    groups = _groups([r for r in quick["data"]["rows"] if r["backend"] == "torch"])
    views: dict[str, set[tuple[Any, ...]]] = {"as allocated": set(), "on huge pages": set()}
    for key, rows in groups.items():
        views[key[4]].add(key[:4] + key[5:])
        assert {r["implementation"] for r in rows} >= {"normkit.torch.RMSNorm", "torch.nn.RMSNorm", "copy (clone)"}
    assert views["on huge pages"] == views["as allocated"]


def test_the_huge_pages_view_refuses_to_run_without_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from normkit.bench import worker

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    sweep = dataclasses.replace(Sweep.make(quick=True), memory="on huge pages")
    with pytest.raises(RuntimeError, match="THP_MEM_ALLOC_ENABLE"):
        worker.run_job({"backend": "torch", "sweep": normkit.bench.sweep_to_dict(sweep)}, lambda event: None)


def test_every_row_has_every_field_and_consistent_figures(quick: dict[str, Any]) -> None:
    for key, rows in _groups(quick["data"]["rows"]).items():
        assert Counter(r["role"] for r in rows)["copy floor"] == 1, key
        (floor,) = [r for r in rows if r["role"] == "copy floor"]
        named = {r["implementation"] for r in rows if r["role"] != "copy floor"}
        for row in rows:
            assert tuple(row) == FIELDS
            assert row["role"] in ROLES and row["pass"] in PASSES
            assert row["role"] != "normkit" or row["implementation"].startswith("normkit.")
            assert len(row["shape"]) == 2 and all(isinstance(n, int) and n > 0 for n in row["shape"])
            assert 0 < row["min_s"] <= row["median_s"] and row["repeats"] >= 3
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
    with pytest.raises(ValueError, match=r"dtype 'int8' is not one of"):
        Sweep.make(dtypes=["int8"])


@pytest.mark.parametrize("empty", ["backends", "devices", "dtypes"])
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
    normkit.bench._alternatives(tf_backend, Sweep.make(quick=True), report, None)
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
    worked: list[tuple[str, dict[str, str] | None, str | None]] = []

    def work(backend: backends.Backend, sweep: Sweep, report_: normkit.bench.Report, progress: Any,
             env: dict[str, str] | None = None, label: str | None = None) -> None:
        worked.append((backend.name, env, label))

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

    def work(backend: backends.Backend, sweep_: Sweep, report_: normkit.bench.Report, *_: Any) -> None:
        if backend.name == "jax":
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
    assert [(r["backend"], r["implementation"]) for r in data["rows"]] == [("torch", "normkit.torch.RMSNorm"), ("torch", "copy")]


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
