"""The conformance runner, report and CLI; `assert_conforms` on right and wrong implementations."""

import dataclasses
import io
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from normkit import cli, conformance
from normkit.conformance import report, runner
from normkit.conformance.cases import FULL_SHAPES, MATRIX_DTYPES, Case, lean, matrix
from normkit.conformance.targets import LEAN_COST, TARGETS, Target, select
from normkit.progress import Progress
from normkit.spec import ALL_KINDS

ROOT = str(Path(__file__).resolve().parents[2])
FAKES = "tests.helpers.conformance_fakes"


def fake(name: str, mode: str) -> Target:
    # targets with the same hook and environment share a worker; a crashing one gets its own
    env = {"PYTHONPATH": ROOT, **({"NORMKIT_FAKE_WORKER": "alone"} if mode == "crash" else {})}
    return Target(name, (), FAKES, {"mode": mode}, env, packages=("numpy",))


# ---- the matrix ------------------------------------------------------------------------------


def base(cases):
    """The cases of the base specs on standard rows."""
    return [c for c in cases if set(c.features) <= {"float64"} and c.rows == "standard"
            and not c.initial]


def test_full_matrix_covers_every_option():
    cases = base(matrix())
    specs = {c.spec for c in cases}
    assert {s.kind for s in specs} == {"rms", "partial_rms", "layer"}
    assert {s.eps_placement for s in specs} == {"inside", "outside"}
    assert {s.scale_offset for s in specs} == {0.0, 1.0}
    assert {s.bias for s in specs} == {False, True}
    assert {c.dtype for c in cases} == {"float32", "float16", "bfloat16", "float64"}
    assert {c.spec.cast for c in cases if c.dtype == "bfloat16"} == {"after_scale", "before_scale"}
    sizes = {int(np.prod(c.spec.param_shape(c.shape))) for c in cases}
    assert {1, 16384, 7} <= sizes
    assert any(len(c.spec.axis) == 2 for c in cases)
    # 3 kinds x 2 placements x 2 offsets x 2 biases x (1 + 2 + 2 + 1 dtype/cast pairs) x shapes
    assert len(cases) == 3 * 2 * 2 * 2 * 6 * len(FULL_SHAPES)


def test_quick_matrix_still_touches_every_option():
    cases = base(matrix(quick=True))
    assert len(cases) == 72
    assert {(c.spec.eps_placement, c.spec.scale_offset, c.spec.bias) for c in cases} == {
        ("inside", 0.0, False),
        ("outside", 1.0, True),
    }
    assert {c.spec.cast for c in cases} == {"after_scale", "before_scale"}


@pytest.mark.parametrize("quick", [True, False])
def test_every_base_spec_has_rows_near_eps_and_layer_norm_rows_of_a_large_mean(quick):
    cases = matrix(quick=quick)
    probed = {(c.spec.replace(axis=-1, cast="after_scale"), c.dtype, c.rows) for c in cases
              if c.rows != "standard"}
    for case in base(cases):
        spec = case.spec.replace(axis=-1, cast="after_scale")
        assert (spec, case.dtype, "eps") in probed, case.label
        assert ((spec, case.dtype, "large_mean") in probed) == (spec.kind == "layer"), case.label


@pytest.mark.parametrize("quick", [True, False])
def test_every_kind_and_dtype_a_filter_names_has_a_case(quick):
    for kind, dtype in itertools.product(ALL_KINDS, MATRIX_DTYPES):
        assert matrix(quick=quick, kinds=(kind,), case_dtypes=(dtype,)), (kind, dtype)


def test_the_targets_that_compile_run_the_lean_default_matrix(monkeypatch):
    planned = {}

    def run(targets, cases_for, **kwargs):
        planned.update({t.name: cases_for(t) for t in targets})
        return runner.Report([], {}, {})

    monkeypatch.setattr(runner, "run", run)
    report = conformance.run(quick=True)
    default = matrix(quick=True)
    assert planned["torch"] == default and planned["tf[tensorflow]"] == default
    for name in ("jax.linen", "tf[tensorflow,jit]", "tf[jax,jit]", "torch[triton]"):
        assert planned[name] == lean(default) and name in report.lean
    assert len(lean(default)) < len(default) / 3
    conformance.run(quick=False)
    assert all(cases == matrix() for cases in planned.values())


def test_case_inputs_are_deterministic_and_serializable():
    case = matrix(quick=True)[7]
    again = Case.from_dict(json.loads(json.dumps(case.to_dict())))
    assert again == case and again.id == case.id
    for a, b in zip(case.inputs(), again.inputs()):
        np.testing.assert_array_equal(a, b)
    x = case.inputs()[0].astype(np.float64)
    assert abs(x.mean()) < 0.2 and 0.8 < x.std() < 1.2


def test_matrix_rejects_unknown_filters():
    with pytest.raises(ValueError, match=r"unknown dtypes \['int8'\]"):
        matrix(case_dtypes=("int8",))
    with pytest.raises(ValueError, match=r"unknown kinds \['batch'\]; allowed: .*'dyt'"):
        matrix(kinds=("batch",))
    with pytest.raises(ValueError, match=r"unknown backends \['mxnet'\]"):
        select(["mxnet"])
    assert [t.name for t in select(["tf"])] == [t.name for t in TARGETS if t.name.startswith("tf[")]


# ---- the runner, on fake targets -------------------------------------------------------------


@pytest.fixture(scope="module")
def fake_report():
    cases = matrix(quick=True, kinds=("rms",), case_dtypes=("float32", "bfloat16"))[:6]
    targets = [
        fake("crashes", "crash"),
        fake("right", "exact"),
        fake("wrong", "eps_outside"),
        fake("raises", "raise"),
        fake("skips", "skip"),
        Target("absent", ("torch",), "x", packages=("no_such_framework_xyz",)),
    ]
    return runner.run(targets, lambda t: cases, progress=False), len(cases)


def test_runner_statuses(fake_report):
    rep, n = fake_report
    by = {
        t: [r.status for r in rep.results if r.target == t]
        for t in ("right", "wrong", "raises", "skips", "crashes")
    }
    assert by["right"] == ["PASS"] * n
    assert by["wrong"] == ["FAIL"] * n
    assert by["raises"] == ["FAIL"] * n and "raised RuntimeError: kernel exploded" in next(
        r.reason for r in rep.results if r.target == "raises"
    )
    assert by["skips"] == ["SKIP"] * n
    assert by["crashes"] == ["FAIL"] * n and all(
        "worker crashed" in r.reason for r in rep.results if r.target == "crashes"
    )
    assert rep.skipped_targets == {
        "absent": "no_such_framework_xyz not installed "
        "(pip install 'normkit[torch]' no_such_framework_xyz)"
    }
    assert set(rep.target_seconds) == {
        "right",
        "wrong",
        "raises",
        "skips",
    }  # the crashed one never finished


def test_wrong_implementation_is_reported_with_figures(fake_report):
    rep, _ = fake_report
    wrong = [r for r in rep.results if r.target == "wrong"]
    assert all(r.measurements["y"]["error"] > r.measurements["y"]["bound"]["value"] for r in wrong)
    assert all("y: FAIL" in r.reason for r in wrong)
    right = [r for r in rep.results if r.target == "right"]
    for r in right:
        assert set(r.measurements) == {"y", "dx", "dscale"} | (
            {"dbias"} if r.case.spec.bias else set()
        )


def test_pairwise_flags_the_disagreeing_pair(fake_report):
    rep, n = fake_report
    pair = next(p for p in rep.pairwise if {p.a, p.b} == {"right@cpu", "wrong@cpu"})
    assert pair.cases == n and pair.disagreements == n and pair.worst > 1


def test_json_and_markdown_hold_every_case(fake_report):
    rep, _ = fake_report
    data = json.loads(report.to_json(rep))
    assert len(data["cases"]) == len(rep.results)
    assert data["summary"]["FAIL"] == len(rep.failed)
    case = next(c for c in data["cases"] if c["target"] == "right")
    assert set(case["measurements"]["y"]) >= {
        "max_abs",
        "max_rel",
        "max_ulp",
        "error",
        "bound",
        "passed",
    }
    md = report.markdown(rep)
    assert "| right@cpu |" in md and "## Failures" in md
    text = report.text(rep)
    assert "right@cpu" in text and "failed:" in text and "skipped:" in text


def test_the_summary_fits_100_columns_and_says_what_each_column_holds(fake_report):
    rep, _ = fake_report
    text = report.text(rep)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    header = lines[0].split()
    assert header == ["implementation", "rms", "partial_rms", "layer", "dyt", "skipped", "worst",
                      "f32/64", "worst", "half", "ulp"]
    joined = " ".join(line.strip() for line in lines)
    assert "worst f32/64: the worst error of any output or gradient in float32 or float64, as a " \
        "fraction of its bound" in joined
    assert "a correct float32 computation reaches 1 where it rounds a near-tie the other way" in joined
    right = next(line for line in lines if line.startswith("right@cpu")).split()
    assert right[1] == f"{sum(r.target == 'right' for r in rep.results)}/" \
        f"{sum(r.target == 'right' for r in rep.results)}"


def test_cli_exit_code_follows_failures(monkeypatch, capsys, fake_report):
    rep, _ = fake_report
    monkeypatch.setattr(conformance, "run", lambda **kwargs: rep)
    assert cli.main(["conformance"]) == 1
    assert "wrong@cpu" in capsys.readouterr().out
    assert cli.main(["conformance", "--peers"]) == 0  # peers' departures are findings


def test_a_stray_print_in_a_worker_neither_hangs_nor_corrupts_the_run():
    cases = matrix(quick=True, kinds=("rms",), case_dtypes=("float32",))[:2]
    chatty = Target(
        "chatty",
        (),
        FAKES,
        {"mode": "print"},
        {"PYTHONPATH": ROOT, "NORMKIT_FAKE_PRINT": "1"},
        packages=("numpy",),
    )
    rep = runner.run([chatty], lambda t: cases, progress=False)
    assert [r.status for r in rep.results] == ["PASS"] * len(cases)


def test_progress_weighs_each_case_by_its_targets_cost(monkeypatch):
    """A compiled target's case counts its ``cost`` in the estimate of the time left."""
    recorded = []

    class Recording(Progress):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, stream=io.StringIO(), **kwargs)
            recorded.append(self)

    monkeypatch.setattr(runner, "Progress", Recording)
    cases = matrix(quick=True, kinds=("rms",), case_dtypes=("float32",))[:2]
    cheap = dataclasses.replace(fake("cheap", "exact"), cost=1.0)
    costly = dataclasses.replace(fake("costly", "exact"), cost=30.0)
    runner.run([cheap, costly], lambda t: cases, pairwise=False)
    (bar,) = recorded
    assert (bar.total, bar.work) == (4, 62.0)
    assert (bar.done, bar.work_done) == (4, 62.0)


def test_a_stray_line_on_the_event_channel_is_a_crash_not_a_hang(monkeypatch):
    monkeypatch.setattr(runner, "WORKER", "tests.helpers.conformance_stray_worker")
    cases = matrix(quick=True, kinds=("rms",), case_dtypes=("float32",))[:2]
    rep = runner.run([fake("stray", "exact")], lambda t: cases, progress=False)
    assert [r.status for r in rep.results] == ["FAIL"] * len(cases)
    assert all(
        r.reason == "worker crashed: the worker wrote a line that is not an event: "
        "'a stray line before the first event'"
        for r in rep.results
    )


def two_cases() -> list[Case]:
    """A case with eps inside and one with eps outside."""
    cases = matrix(quick=True, kinds=("rms",), case_dtypes=("float32",))
    return [next(c for c in cases if c.spec.eps_placement == p) for p in ("inside", "outside")]


def test_a_worker_killed_by_a_signal_is_restarted_for_the_cases_left(tmp_path):
    target = Target(
        "flaky", (), FAKES, {"mode": "segfault_once"},
        {"PYTHONPATH": ROOT, "NORMKIT_FAKE_MARKER": str(tmp_path / "crashed")},
        packages=("numpy",),
    )
    rep = runner.run([target], lambda t: two_cases(), progress=False)
    assert [r.status for r in rep.results] == ["PASS", "PASS"]
    (line,) = rep.restarts
    assert line.startswith("flaky: exit status -11") and "restarted for the cases left" in line
    assert "workers restarted after a signal killed them:\n  flaky: exit status -11" in (
        report.text(rep)
    )
    assert json.loads(report.to_json(rep))["restarts"] == [line]


def test_a_case_that_kills_its_worker_twice_fails_and_the_rest_still_run():
    target = Target("fragile", (), FAKES, {"mode": "segfault_outside"}, {"PYTHONPATH": ROOT},
                    packages=("numpy",))
    cases = two_cases()
    rep = runner.run([target], lambda t: cases[::-1], progress=False)  # the crashing one first
    by_case = {r.case.spec.eps_placement: r for r in rep.results}
    assert len(rep.results) == 2 and by_case["inside"].status == "PASS"
    assert by_case["outside"].status == "FAIL"
    assert by_case["outside"].reason.startswith(
        "the worker was killed twice running this case: exit status -11"
    )
    assert len(rep.restarts) == 2


# ---- the real thing --------------------------------------------------------------------------


def test_quick_conformance_passes_on_every_backend(tmp_path):
    out = tmp_path / "quick.json"
    md = tmp_path / "quick.md"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "normkit",
            "conformance",
            "--json",
            str(out),
            "--markdown",
            str(md),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "implementation" in done.stdout and "passed, 0 failed" in done.stdout
    data = json.loads(out.read_text())
    ran = {c["target"] for c in data["cases"]}
    assert ran == {t.name for t in TARGETS}, data["skipped_targets"]
    default, trimmed = len(matrix(quick=True)), len(lean(matrix(quick=True)))
    assert set(data["lean"]) == {t.name for t in TARGETS if t.cost >= LEAN_COST}
    assert len(data["cases"]) == sum(trimmed if t.name in data["lean"] else default
                                     for t in TARGETS)
    for case in data["cases"]:
        if case["status"] == "SKIP":  # only a named kernel, on a field it does not compute
            assert case["target"] in ("torch[cpu-kernel]", "torch[triton]"), case
            assert "does not compute NormSpec." in case["reason"], case
            continue
        assert case["status"] == "PASS", case
        assert {"y", "dx"} <= set(case["measurements"])
        assert all(m["max_ulp"] >= 0 and m["max_rel"] >= 0 for m in case["measurements"].values())
    assert len(data["pairwise"]) == len(TARGETS) * (len(TARGETS) - 1) // 2
    assert all(p["disagreements"] == 0 for p in data["pairwise"])
    assert "| torch@cpu |" in md.read_text()


def test_cli_names_an_unknown_filter(capsys):
    assert cli.main(["conformance", "--backend", "mxnet"]) == 2
    assert "normkit conformance: error: unknown backends ['mxnet']" in capsys.readouterr().err
    assert cli.main(["conformance", "--dtype", "int8"]) == 2
    assert "unknown dtypes ['int8']" in capsys.readouterr().err


def test_cli_identify_prints_the_spec_of_a_builtin(capsys):
    pytest.importorskip("torch")
    assert cli.main(["identify", "torch.nn.LayerNorm", "--n", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("torch.nn.LayerNorm (size 16) behaves as:")
    assert "NormSpec('layer', eps=1e-05)" in out
