"""The harness on the extended spec: the quantities of each spec, `compare` on the reference's
own outputs and on outputs broken in one named way, and the worker through a fake hook that
implements the hook contract with the reference."""

import json
from pathlib import Path

import numpy as np
import pytest

from normkit import cli, conformance, dtypes
from normkit.conformance import report, runner
from normkit.conformance.cases import FEATURES, MATRIX_DTYPES, Case, matrix
from normkit.conformance.compare import compare, expected_dtypes, quantities
from normkit.conformance.targets import Target
from normkit.spec import ALL_KINDS, RESIDUALS, NormSpec
from tests.helpers.conformance_fakes import bump, reference_outputs

ROOT = str(Path(__file__).resolve().parents[2])
FAKES = "tests.helpers.conformance_fakes"


def test_quantities_name_what_each_spec_returns():
    assert quantities(NormSpec()) == ("y", "dx", "dscale", "dbias")
    assert quantities(NormSpec("layer", variance="fast")) == ("y", "dx", "dscale", "dbias")
    assert quantities(NormSpec(residual="float32")) == (
        "y", "dx", "dscale", "dbias", "h", "dresidual"
    )
    assert quantities(NormSpec("dyt")) == ("y", "dx", "dscale", "dbias", "dalpha")
    assert quantities(NormSpec("dyt", residual="rounded")) == (
        "y", "dx", "dscale", "dbias", "h", "dresidual", "dalpha"
    )


# One case per new field, each with the dtypes where it matters.
CASES = [
    Case(NormSpec(residual="rounded", cast="before_scale"), (6, 16), "bfloat16"),
    Case(NormSpec(residual="float32"), (6, 16), "float16"),
    Case(NormSpec("layer", residual="float32_normalized"), (6, 16), "bfloat16"),
    Case(NormSpec("layer", variance="fast"), (6, 16), "float32"),
    Case(NormSpec(scale_offset=1.0, offset_dtype="param"), (6, 16), "float32", "bfloat16"),
    Case(NormSpec(output_dtype="promote", cast="before_scale"), (6, 16), "bfloat16"),
    Case(NormSpec(output_dtype="promote"), (6, 16), "float32", "float16"),
    Case(NormSpec("dyt", alpha_init=1.0), (6, 16), "float16", "float16"),
    Case(NormSpec("dyt", residual="rounded", bias=False), (6, 16), "float64"),
    Case(NormSpec(cast="before_scale", backward="autograd"), (6, 16), "bfloat16", "bfloat16"),
    Case(NormSpec("partial_rms", p=0.5), (6, 16), "float64"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_the_reference_conforms_to_itself(case):
    inputs = case.arrays()
    problems, measured = compare(case.spec, inputs, reference_outputs(case.spec, inputs))
    assert problems == []
    present = [q for q, v in zip(quantities(case.spec), reference_outputs(case.spec, inputs))
               if v is not None]
    assert sorted(measured) == sorted(present)


BROKEN = [
    (CASES[0], "h"), (CASES[1], "h"), (CASES[1], "dresidual"), (CASES[2], "dresidual"),
    (CASES[7], "dalpha"), (CASES[8], "dalpha"), (CASES[4], "y"), (CASES[9], "dx"),
    (CASES[9], "dscale"),
]


@pytest.mark.parametrize("case, name", BROKEN, ids=lambda v: getattr(v, "label", v))
def test_a_perturbed_quantity_fails_by_name(case, name):
    inputs = case.arrays()
    outputs = list(reference_outputs(case.spec, inputs))
    i = quantities(case.spec).index(name)
    outputs[i] = bump(outputs[i])
    problems, measured = compare(case.spec, inputs, outputs)
    assert [p.split(":")[0] for p in problems] == [name]
    assert not measured[name].passed


def test_a_wrong_output_dtype_or_h_dtype_is_named():
    promote = CASES[5]  # bfloat16 x, float32 params: y is float32
    inputs = promote.arrays()
    assert expected_dtypes(promote.spec, inputs)["y"] == np.float32
    outputs = list(reference_outputs(promote.spec, inputs))
    outputs[0] = outputs[0].astype(dtypes.bfloat16)
    problems, _ = compare(promote.spec, inputs, outputs)
    assert problems == ["y has dtype bfloat16, expected float32"]
    kept = CASES[1]  # residual="float32" with float16 x: h is float32
    inputs = kept.arrays()
    assert inputs.dh.dtype == np.float32 and inputs.residual.dtype == np.float16
    outputs = list(reference_outputs(kept.spec, inputs))
    outputs[4] = outputs[4].astype(np.float16)
    problems, _ = compare(kept.spec, inputs, outputs)
    assert problems[0] == "h has dtype float16, expected float32"


def test_a_missing_quantity_is_named():
    case = CASES[8]
    inputs = case.arrays()
    problems, measured = compare(case.spec, inputs, reference_outputs(case.spec, inputs)[:4])
    assert problems == [
        "returned 4 arrays, expected 7: y, dx, dscale, dbias, h, dresidual, dalpha"
    ]
    assert measured == {}


def test_the_new_inputs_are_drawn_only_where_the_spec_has_them():
    plain = Case(NormSpec(), (4, 8), "bfloat16").arrays()
    assert plain.residual is plain.dh is plain.alpha is None
    dyt = Case(NormSpec("dyt", alpha_init=0.5), (4, 8), "float32", "bfloat16").arrays()
    assert dyt.alpha.shape == (1,) and dyt.alpha.dtype == dtypes.bfloat16
    assert 0.3 < float(dyt.alpha[0]) < 0.7
    again = Case(NormSpec("dyt", alpha_init=0.5), (4, 8), "float32", "bfloat16").arrays()
    for a, b in zip(dyt, again):
        np.testing.assert_array_equal(a, b)
    kept = Case(NormSpec(residual="float32"), (4, 8), "bfloat16")
    assert Case.from_dict(json.loads(json.dumps(kept.to_dict()))) == kept
    inputs = kept.arrays()
    assert inputs.residual.dtype == dtypes.bfloat16 and inputs.dh.dtype == np.float32
    x, dy, scale, bias = kept.inputs()
    for a, b in zip((x, dy, scale, bias), inputs[:4]):
        np.testing.assert_array_equal(a, b)


# ---- the worker, through the fake hook ------------------------------------------------------


def fake(name, mode):
    return Target(name, (), FAKES, {"mode": mode}, {"PYTHONPATH": ROOT}, packages=("numpy",))


@pytest.fixture(scope="module")
def extended_report():
    targets = [
        fake("right", "exact"),
        fake("right too", "plain_call"),
        fake("wrong h", "wrong_h"),
        fake("wrong dalpha", "wrong_dalpha"),
    ]
    return runner.run(targets, lambda t: CASES, progress=False)


def test_the_worker_passes_the_contract_keywords(extended_report):
    by = {}
    for r in extended_report.results:
        by.setdefault(r.target, []).append(r)
    assert [r.status for r in by["right"]] == ["PASS"] * len(CASES)
    for r in by["right"]:
        assert set(r.measurements) >= set(quantities(r.case.spec)) - {"dbias", "dscale"}
    # a hook that refuses the extended keywords fails exactly the cases that need them
    extended = [c.spec.residual is not None or c.spec.kind == "dyt" for c in CASES]
    assert [r.status == "FAIL" for r in by["right too"]] == extended
    assert all(
        "raised TypeError: a plain spec's call got the extended keywords" in r.reason
        for r in by["right too"] if r.status == "FAIL"
    )
    wrong_h = [r for r in by["wrong h"] if r.status == "FAIL"]
    assert {r.case for r in wrong_h} == {c for c in CASES if c.spec.residual is not None}
    assert all(r.reason.startswith("h: FAIL") for r in wrong_h)
    wrong_dalpha = [r for r in by["wrong dalpha"] if r.status == "FAIL"]
    assert {r.case for r in wrong_dalpha} == {c for c in CASES if c.spec.kind == "dyt"}
    assert all(r.reason.startswith("dalpha: FAIL") for r in wrong_dalpha)


def test_the_reports_show_the_new_fields(extended_report):
    data = json.loads(report.to_json(extended_report))
    case = next(c for c in data["cases"] if c["target"] == "right" and c["spec"]["kind"] == "dyt")
    assert "dalpha" in case["measurements"] and "dyt" in case["features"]
    assert case["case"].startswith("dyt alpha_init=1 bias")
    md = report.markdown(extended_report)
    table = md.split("## Extended fields")[1].split("##")[0]
    assert "| implementation | residual | variance | offset_dtype | output_dtype | backward | dyt" \
        " | float64 |" in table
    # the four cases with a residual (three roundings and DyT's): "wrong h" fails them all
    assert "| right@cpu | 4/4 |" in table and "| wrong h@cpu | 0/4 |" in table
    assert "| dyt |" in md.split("\n")[4]


def test_pairwise_reads_the_new_quantities(extended_report):
    pair = next(p for p in extended_report.pairwise if {p.a, p.b} == {"right@cpu", "wrong h@cpu"})
    assert pair.disagreements == sum(c.spec.residual is not None for c in CASES)
    same = next(p for p in extended_report.pairwise if {p.a, p.b} == {"right@cpu", "right too@cpu"})
    assert same.disagreements == 0 and same.worst == 0


# ---- the matrix's families ------------------------------------------------------------------


def test_each_family_exercises_its_field_in_full_and_quick():
    full, quick = matrix(), matrix(quick=True)
    # the original matrix, its families and the probes: rows near eps, of a large mean, near
    # rounding ties, and the layers' initial parameters
    assert len(full) == len({c.id for c in full}) == 1131
    assert len(quick) == len({c.id for c in quick}) == 124
    for cases in (full, quick):
        by_feature = {f: [c for c in cases if f in c.features] for f in FEATURES}
        assert all(by_feature.values()), [f for f, found in by_feature.items() if not found]
    # every residual rounding on half and float32 inputs
    residual = {(c.spec.residual, c.dtype) for c in full if c.spec.residual}
    assert {(m, d) for m in RESIDUALS for d in ("float32", "bfloat16", "float16")} <= residual
    dyt = [c for c in full if c.spec.kind == "dyt"]
    assert {(c.spec.alpha_init, c.spec.bias) for c in dyt} == {
        (a, b) for a in (0.5, 1.0) for b in (True, False)
    }
    assert {c.dtype for c in dyt} == set(MATRIX_DTYPES)
    offset = [c for c in full if c.spec.offset_dtype == "param"]
    assert {c.param_dtype for c in offset} == {"bfloat16", "float16"}
    assert all(c.spec.scale_offset == 1 for c in offset)
    promote = {(c.dtype, c.param_dtype) for c in full if c.spec.output_dtype == "promote"}
    assert {("bfloat16", "float32"), ("float32", "bfloat16"), ("float32", "float16")} <= promote
    autograd = {(c.dtype, c.spec.cast) for c in full if c.spec.backward == "autograd"}
    assert {(d, k) for d in ("bfloat16", "float16") for k in ("after_scale", "before_scale")} == (
        autograd
    )
    assert {c.dtype for c in full if c.spec.variance == "fast"} == set(MATRIX_DTYPES)
    gated = {(c.spec.gate, c.spec.gate_activation, c.dtype) for c in full if c.spec.gate}
    assert {("before", "silu"), ("after", "silu"), ("after", "sigmoid")} <= {g[:2] for g in gated}
    assert {g[2] for g in gated} == set(MATRIX_DTYPES)
    grouped = [c for c in full if c.spec.group_size]
    assert {c.spec.kind for c in grouped} == {"rms", "layer"} and any(c.spec.gate for c in grouped)
    extended = [c for c in full if set(c.features) - {"float64"} and c.rows == "standard"
                and not c.initial]
    assert len(extended) == 130  # small beside the 864 of the original matrix in four dtypes


def test_the_families_are_deterministic_and_labelled():
    first = [(c.id, c.label) for c in matrix()]
    assert first == [(c.id, c.label) for c in matrix()]
    labels = [c.label for c in matrix(quick=True) if c.features]
    for needle in ("residual=rounded", "variance=fast", "offset_dtype=param",
                   "output_dtype=promote", "dyt alpha_init=0.5", "backward=autograd",
                   "float64[5, 7]", "params bfloat16"):
        assert any(needle in label for label in labels), needle


def test_kind_and_dtype_filters_reach_the_families():
    dyt = matrix(kinds=("dyt",))
    assert dyt and all(c.spec.kind == "dyt" for c in dyt)
    quick = matrix(kinds=("dyt",), quick=True)
    assert {c.dtype for c in quick} == set(MATRIX_DTYPES)  # any --dtype with --kind dyt
    assert [c.initial for c in quick].count(True) == 1  # the layer's own alpha_init
    f64 = matrix(case_dtypes=("float64",))
    assert f64 and all(c.dtype == "float64" for c in f64)
    assert {c.spec.kind for c in f64} == {"rms", "partial_rms", "layer", "dyt"}
    assert all(c.spec.cast == "after_scale" for c in f64)


def test_the_cli_runs_dyt_in_float64(monkeypatch, capsys):
    asked = {}

    def run(**kwargs):
        asked.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(conformance, "run", run)
    with pytest.raises(SystemExit):
        cli.main(["conformance", "--kind", "dyt", "--dtype", "float64"])
    assert asked["kinds"] == ("dyt",) and asked["dtypes"] == ("float64",)
    with pytest.raises(SystemExit):
        cli.main(["conformance"])
    assert asked["kinds"] == ALL_KINDS and asked["dtypes"] is None
