"""scripts/gpu-check without a GPU: one line, exit 0 when it finds normkit's pieces; and its
steps timeboxed, recorded in summary.json, where a fake nvidia-smi stands in for a GPU."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import normkit
from normkit.conformance.targets import select
from tests.helpers import fake_gpu

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"
GPU_TARGETS = ["torch", "jax", "tf[jax,jit]", "tf[torch]"]

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="a POSIX script")


def gpu_check(*args, path, cwd=ROOT, timeout=180, pythonpath=None):
    """Run the script with ``PATH=path`` (no nvidia-smi there unless put there) and, if given,
    ``pythonpath`` on the steps' Python path."""
    env = {**os.environ, "PATH": str(path)}
    env.pop("OUT", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, str(cwd / "scripts" / "gpu-check"), *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path):
    done = gpu_check(path=tmp_path)  # a PATH without nvidia-smi: no GPU, whatever the machine
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    [line] = done.stdout.splitlines()
    targets = ", ".join(t.name for t in select(GPU_TARGETS))
    assert line.startswith(
        f"gpu-check: no GPU (nvidia-smi lists none): nothing run; found normkit "
        f"{normkit.__version__} in {ROOT} (command, conformance targets {targets}, bench, "
        "kernel tests)"
    ), line
    assert "missing:" not in line


def test_check_alone_runs_nothing_even_with_a_gpu(tmp_path):
    fake_gpu.install(tmp_path)
    done = gpu_check("--check", "--out", str(tmp_path / "out"), path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gpu-check: --check: nothing run; found normkit")
    assert len(done.stdout.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_tree_without_normkit_is_an_error_naming_what_is_missing(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "gpu-check")
    done = gpu_check(path=tmp_path, cwd=tmp_path)
    assert done.returncode == 1
    [line] = done.stdout.splitlines()
    assert "missing: test files ['tests/torch/test_torch_triton_kernel.py'" in line
    assert f"normkit in {tmp_path}" in line


#: What each step's command writes when stopped, as normkit writes what it finished on SIGTERM.
STOPPED_REPORTS = {
    "bench": {"interrupted": True, "rows": [{"implementation": "copy"}]},
    "conformance": {"interrupted": True, "skipped_targets": {},
                    "cases": [{"target": "torch", "status": "PASS"}]},
}


@pytest.mark.parametrize("step", ["bench", "conformance"])
def test_a_step_past_its_time_is_stopped_and_recorded_with_what_it_wrote(tmp_path, step):
    out = tmp_path / "results"
    path = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"
    # Every `python -m normkit bench` or `conformance` the step starts sleeps past its limit,
    # however fast the machine (a run on a fake GPU would otherwise fail at once, or not, by how
    # fast it starts), and on SIGTERM writes a report of one row or case.
    slow = fake_gpu.install(tmp_path, [(["-m", step], STOPPED_REPORTS[step])])
    done = gpu_check("--only", step, "--budget", "20", "--out", str(out), path=path, pythonpath=slow)
    assert done.returncode == 1, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gpu"] == fake_gpu.GPU_NAME and summary["device"] == "cuda:0"
    [record] = summary["steps"]
    assert record["step"] == step and record["status"] == "timeout" and record["log"] == f"{step}.log"
    assert record["interrupted"] is True
    if step == "bench":
        assert record["rows"] == 1
    else:
        assert record["targets"] == {"torch": {"PASS": 1}}
    assert record["seconds"] < 20 + 10  # and the kill grace
    log = (out / f"{step}.log").read_text()
    assert f"normkit {step} --backend torch" in log
    assert "stopped at its limit" in log
    assert sorted(p.name for p in out.iterdir()) == [f"{step}.json", f"{step}.log", "summary.json"]


def _probe(tmp_path, *args):
    out = tmp_path / "probe.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "jax_probe.py"), "--out", str(out),
                           "--shapes", "8x64", *args], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_the_jax_probe_checks_the_kernels_on_the_edge_rows(tmp_path):
    """scripts/jax_probe.py's check (the kernels step's first command), here with the kernels in
    Pallas' interpreter: every checked spec on the edge rows within the reference's tolerance."""
    pytest.importorskip("flax")
    records = _probe(tmp_path, "--sections", "check", "--interpret")
    checked = [r for r in records if "check" in r]
    assert len(checked) >= 8 and all(r["problems"] == [] for r in checked), checked


def test_the_jax_probe_times_each_implementation_in_both_modes(tmp_path):
    """The probe's timings on a small shape here: each layer and pass, normkit.jax with the
    kernels and with XLA against Flax, Keras' layers against normkit.tf's, the APIs, and every
    option over the default, each in throughput and latency mode beside the copy floor."""
    pytest.importorskip("flax")
    pytest.importorskip("keras")
    records = _probe(tmp_path, "--dtypes", "float32", "--sections",
                     "layers,options,keras,apis,launch", "--budget", "500")
    assert records[-1]["seconds"] > 0 and not any("stopped" in r for r in records)
    sections = {"layers": ("normkit[pallas]", "normkit[xla]", "flax", "copy"),
                "keras": ("normkit.tf[pallas]", "normkit.tf[xla]", "keras", "copy"),
                "apis": ("linen", "nnx", "functional")}
    for section, names in sections.items():
        found = [r for r in records if r.get("section") == section]
        assert {(r["layer"], r["pass"]) for r in found} == {
            (layer, p) for layer in ("RMSNorm", "LayerNorm") for p in ("forward", "forward+backward")
        }
        for r in found:
            assert set(r["ms"]) == {"throughput", "latency"}
            assert all(set(times) == set(names) for times in r["ms"].values())
            assert all(ms > 0 for times in r["ms"].values() for ms in times.values())
    options = [r for r in records if r.get("section") == "options"]
    assert [r["pass"] for r in options] == ["forward", "forward+backward"]
    for r in options:
        assert r["over_default"]["default"] == 1 and len(r["over_default"]) >= 15
    launches = [r for r in records if r.get("section") == "launch"]
    assert [r["pass"] for r in launches] == ["forward", "forward+backward"]
    assert all(r["over_default"]["default"] == 1 and len(r["ms"]) >= 3 for r in launches)


def test_a_failure_is_printed_before_the_run_ends(tmp_path):
    """gpu-check stops its test commands at their limits, before pytest's summary: the plugin
    it passes them names each failure and its traceback as it happens."""
    (tmp_path / "test_probe.py").write_text(
        "import time\n"
        "def test_fails():\n    assert 1 + 1 == 3, 'one and one are not three'\n"
        "def test_outlasts_the_limit():\n    time.sleep(30)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p",
         "tests.helpers.failures_at_once", "-q", "-rfE", "--rootdir", str(tmp_path),
         str(tmp_path / "test_probe.py")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith("=== end of"):
                break
    finally:
        process.kill()
        process.wait()
    printed = "".join(lines)
    assert "=== FAILED test_probe.py::test_fails (call)" in printed
    assert "one and one are not three" in printed
    assert "short test summary" not in printed  # pytest itself had not reported it yet


@pytest.mark.parametrize("only, message", [
    (",", "argument --only: ',' names nothing: give at least one step"),
    ("", "argument --only: '' names nothing: give at least one step"),
    ("conformance,", "argument --only: 'conformance,' has an empty name between its commas"),
])
def test_an_empty_selection_is_a_usage_error(tmp_path, only, message):
    done = gpu_check("--only", only, path=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1] == f"gpu-check: error: {message}"
