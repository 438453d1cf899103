"""Batch invariance: the check catches each kind of dependence, and normkit's own torch kernels
(the CPU kernel, the composite path, the Triton kernels through the interpreter) give a row the
same bits whatever its batch, its position there and the thread count."""

from __future__ import annotations

import json

import numpy as np
import pytest

from normkit import NormSpec
from normkit.conformance import batch_invariance

torch = pytest.importorskip("torch")

from normkit.torch.functional import normalize  # noqa: E402


def _rows(n: int, count: int = max(batch_invariance.BATCH_ROWS)) -> np.ndarray:
    return np.random.default_rng(n).standard_normal((count, n)).astype(np.float32)


def _rms(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x.astype(np.float32) ** 2, axis=-1, keepdims=True) + 1e-6)


def test_an_invariant_function_passes():
    found = batch_invariance.check(_rms, _rows(16))
    assert found.invariant and found.describe().startswith("batch-invariant")


def test_each_dependence_is_caught():
    x = _rows(16)
    whole_batch = batch_invariance.check(lambda a: a / np.sqrt(np.mean(a**2)), x)
    assert not whole_batch.rows and not whole_batch.invariant
    # a tiny term that grows with the position in the batch: order and position show it
    by_position = batch_invariance.check(
        lambda a: _rms(a) * (1 + 2.0**-20 * np.arange(len(a))[:, None]).astype(np.float32), x
    )
    assert by_position.rows and not by_position.order and not by_position.position
    assert "row order, row position" in by_position.describe()
    with pytest.raises(ValueError, match="at least 509 rows"):
        batch_invariance.check(_rms, x[:10])


def test_a_careful_program_for_the_whole_batch_is_caught():
    """issue 48, defect 4: an implementation that computes every row of a batch another way
    when one row needs it (here: in float64 where a row holds a NaN or values whose squares
    overflow float32) changes the ordinary rows' bits in that batch. Ordinary rows alone never
    show it; the largest batch holds such rows away from the compared ones."""

    def careful_when_needed(a: np.ndarray) -> np.ndarray:
        wide = a.astype(np.float64)
        if np.isfinite(np.sum(a.astype(np.float32) ** 2, axis=-1)).all():
            return _rms(a)
        return (wide / np.sqrt(np.mean(wide**2, axis=-1, keepdims=True) + 1e-6)).astype(a.dtype)

    found = batch_invariance.check(careful_when_needed, _rows(64))
    assert found.dependencies() == ["row count", "row position"]


SPECS = [NormSpec(), NormSpec("layer"), NormSpec("partial_rms", p=0.25), NormSpec(cast="before_scale")]


@pytest.mark.parametrize("kernel", ["cpu", "composite"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 4096])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind + "-" + s.cast)
def test_torch_cpu_paths_are_batch_and_thread_invariant(spec, n, dtype, kernel):
    pytest.importorskip("numba") if kernel == "cpu" else None
    weight = torch.linspace(0.5, 1.5, n)

    def forward(a: np.ndarray) -> np.ndarray:
        y = normalize(torch.from_numpy(a).to(dtype), spec, weight, kernel=kernel)
        return y.float().numpy()

    x = _rows(n)
    assert batch_invariance.check(forward, x).invariant
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = forward(x[:8])
        torch.set_num_threads(2)
        two = forward(x[:8])
    finally:
        torch.set_num_threads(threads)
    assert one.tobytes() == two.tobytes()


def test_triton_kernels_are_batch_invariant(monkeypatch):
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = NormSpec("layer")

    def forward(a: np.ndarray) -> np.ndarray:
        y = normalize(torch.from_numpy(a).to(device), spec, kernel="triton")
        return y.cpu().numpy()

    assert batch_invariance.check(forward, _rows(32, 9), batch_rows=(1, 2, 5, 9)).invariant


# ---- the report's column, through the runner on fake targets ------------------------------------

FAKES = "tests.helpers.conformance_fakes"


def test_the_report_states_each_targets_batch_invariance():
    from pathlib import Path

    from normkit.conformance import report, runner
    from normkit.conformance.targets import Target

    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    targets = [
        Target(name, (), FAKES, {"mode": mode}, env, packages=("numpy",))
        for name, mode in (("rowwise", "exact"), ("batched", "batch_dependent"))
    ]
    rep = runner.run(targets, lambda t: [], progress=False, invariance=True)
    labels = [p.label for p in batch_invariance.PROBES]
    assert sorted(rep.batch_invariance) == ["batched@cpu", "rowwise@cpu"]
    for label in labels:
        assert rep.batch_invariance["rowwise@cpu"][label] == {
            "rows": True, "order": True, "position": True, "threads": None,
        }
        # odd batches (1, 3, 509) against the even 64: the row count; an odd batch of one row
        # against the same row in the odd 509: position and order are unchanged
        assert rep.batch_invariance["batched@cpu"][label] == {
            "rows": False, "order": True, "position": True, "threads": None,
        }
    summary = report.text(rep)
    lines = summary.splitlines()
    assert "batch-invariant (does a row's output depend on the rest of its batch?):" in lines
    assert "  yes: rowwise@cpu" in lines
    depends = f"  no: depends on the row count ({'; '.join(labels)}): batched@cpu"
    assert depends in summary.replace("\n    ", " ")  # wrapped to the width
    assert "Batch invariance is not part of the verdict: every row above is within its bound" in (
        summary.replace("\n  ", " ")
    )
    assert max(map(len, lines)) <= 100
    md = report.markdown(rep)
    assert "## Batch invariance" in md
    assert "| batched@cpu | row count | row count | row count |" in md
    assert "| rowwise@cpu | invariant | invariant | invariant |" in md
    assert json.loads(report.to_json(rep))["batch_invariance"] == rep.batch_invariance


def test_the_torch_target_checks_the_thread_count_and_names_what_it_skips():
    from normkit.conformance import targets_torch

    found = batch_invariance.probe(
        targets_torch.evaluate, batch_invariance.PROBES[0], device="cpu",
        set_threads=targets_torch.set_threads, kernel="composite",
    )
    assert found == batch_invariance.BatchInvariance(True, True, True, True)
    assert targets_torch.probes_skipped("cpu", kernel="triton")
    assert targets_torch.probes_skipped("cpu", kernel="cpu") is None
