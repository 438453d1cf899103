"""normkit bench --model: the same small language model in torch, Keras and Flax.

The whole-model check: on the tiny configuration every installed framework trains the model with
every norm for a few eager steps, each from the weights written once (the norms moved with
normkit.port); their losses at step 0 equal a float64 numpy forward of the same model (the norms
from normkit.reference) within the float32 bound `ModelConfig.step0_tolerance`, and so agree
with one another, also over the optimizer's first steps; and the loss falls. No timing
assertions: speed is the benchmark's business (docs/benchmarks-e2e.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from normkit import backends, port, reference
from normkit.bench import model
from normkit.bench.model import config as cfg
from normkit.bench.model import data, plot, results, weights
from normkit.bench.model.config import IDENTITY, NORMS, SIZES, ModelConfig
from tests.helpers import fake_gpu

ROOT = Path(__file__).resolve().parents[2]
INSTALLED = [b.name for b in backends.BACKENDS if not b.missing() or b.alternative()]
FRAMEWORKS = {"torch": "torch", "tf": "keras", "jax": "flax"}
TINY = dataclasses.replace(SIZES["tiny"], eager_steps=3)


# A float64 forward of the model in numpy: the reference the frameworks' step-0 losses are held to.

def _norm(x: np.ndarray, layer: tuple[dict[str, np.ndarray], object] | None) -> np.ndarray:
    if layer is None:
        return x
    params, spec = layer
    return reference.normalize(x, spec, params.get("scale"), params.get("bias"),
                               params.get("alpha")).astype(np.float64)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    first, second = np.split(x, 2, axis=-1)
    return x * cos[:, None] + np.concatenate([-second, first], axis=-1) * sin[:, None]


def reference_loss(config: ModelConfig, folder: Path, norm: str) -> float:
    """The model's loss on batch 0 with the weights in ``folder``, in float64."""
    w = {k: v.astype(np.float64) for k, v in weights.read_matrices(folder).items()}
    norms = {} if norm == IDENTITY else port.load_norms(weights.norms_file(folder, norm))
    batch = data.batches(config)
    tokens, targets, mask = batch.inputs[0], batch.targets[0], batch.weights
    cos, sin = (t.astype(np.float64) for t in weights.rope(config))
    b, t, h, d = *tokens.shape, config.heads, config.head_dim
    x = w["embed"][tokens]
    causal = np.tril(np.ones((t, t), bool))
    for i in range(config.layers):
        a = _norm(x, norms.get(f"blocks.{i}.attention_norm"))
        q, k, v = (
            (a @ w[f"blocks.{i}.attention.{n}"]).reshape(b, t, h, d) for n in ("query", "key", "value")
        )
        scores = np.einsum("bqhd,bkhd->bhqk", _rotate(q, cos, sin), _rotate(k, cos, sin)) / np.sqrt(d)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        y = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, h * d)
        x = x + y @ w[f"blocks.{i}.attention.out"]
        m = _norm(x, norms.get(f"blocks.{i}.mlp_norm"))
        gate = m @ w[f"blocks.{i}.mlp.gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (m @ w[f"blocks.{i}.mlp.up"])) @ w[f"blocks.{i}.mlp.down"]
    logits = _norm(x, norms.get("norm")) @ w["head"]
    top = logits.max(-1, keepdims=True)
    logsumexp = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    ce = logsumexp - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float((ce * mask).sum() / (mask.sum() * b))


@pytest.fixture(scope="module")
def tiny_run() -> model.ModelReport:
    """Every installed framework, every norm, a few eager steps on the tiny configuration."""
    if not INSTALLED:
        pytest.skip("no framework installed")
    return model.run(config=TINY, modes=["eager"], identity=False, profile=False, progress=False)


def test_every_framework_and_norm_trains_and_the_loss_falls(tiny_run):
    assert tiny_run.errors == {} and tiny_run.skipped == {} and not tiny_run.interrupted
    trained = {(r["framework"], r["norm"]) for r in tiny_run.runs}
    assert trained == {(FRAMEWORKS[b], n) for b in INSTALLED for n in NORMS}
    for run in tiny_run.runs:
        assert run["mode"] == "eager" and len(run["losses"]) == len(run["step_s"]) == 3
        assert all(np.isfinite(run["losses"])) and min(run["step_s"]) > 0
        # Falls: below the start on a later (fresh) batch. DyT's signal starts small (tanh of
        # the embeddings, std 0.02, times alpha 0.5) and its loss falls slowest.
        assert min(run["losses"][1:]) < run["losses"][0], (run["implementation"], run["losses"])
        assert run["median_step_s"] is not None and run["tokens_per_s"] > 0


def test_the_step0_losses_equal_a_float64_forward_and_agree_across_frameworks(tiny_run, tmp_path):
    """The same weights (the norms through normkit.port files) and the same batch give the
    same loss in every framework: each within the float32 bound of a float64 numpy forward of
    the model, the norms computed by normkit.reference."""
    tolerance = TINY.step0_tolerance()
    assert 1e-5 < tolerance < 1e-3  # the bound is a few hundred units of float32's rounding
    weights.write(TINY, tmp_path, list(NORMS))
    for norm in NORMS:
        expected = reference_loss(TINY, tmp_path, norm)
        assert 2.4 < expected < 2.7  # about log(13): the start of training
        for run in (r for r in tiny_run.runs if r["norm"] == norm):
            assert run["losses"][0] == pytest.approx(expected, abs=tolerance), run["implementation"]
    agreement = tiny_run.agreement
    if len(INSTALLED) > 1:
        assert agreement["within_tolerance"] is True
        assert set(agreement["step0_spread"]) == set(NORMS)
        # The optimizer's steps too: the three AdamWs take the same steps (Keras' epsilon and
        # its sparse embedding gradient aligned, see normkit.bench.model.keras.AdamW).
        assert max(agreement["first_steps_spread"].values()) <= tolerance


def test_the_norms_differ_so_the_check_would_see_a_wrong_one(tmp_path):
    """The reference tells the norms apart at step 0 by far more than the tolerance, and a norm
    parameter left at its initial value (not moved) changes the loss by more than it too."""
    weights.write(TINY, tmp_path, list(NORMS))
    losses = {norm: reference_loss(TINY, tmp_path, norm) for norm in ("rms", "layer", "partial-rms", "dyt")}
    values = sorted(losses.values())
    assert min(b - a for a, b in zip(values, values[1:])) > 5 * TINY.step0_tolerance()
    unjittered = dataclasses.replace(TINY, norm_jitter=0.0)
    weights.write(unjittered, tmp_path, ["rms"])
    assert abs(reference_loss(unjittered, tmp_path, "rms") - losses["rms"]) > 10 * TINY.step0_tolerance()


def test_the_table_and_the_figures_of_a_run(tiny_run, tmp_path):
    text = results.table(tiny_run.runs, tiny_run.config)
    for run in tiny_run.runs:
        assert run["implementation"] in text
    written = plot.plot(tmp_path / "model.png", tiny_run.runs, tiny_run.config)
    assert written == [tmp_path / "model.png", tmp_path / "model-loss.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size < 200_000


def test_derived_numbers_of_runs():
    """vs_layernorm and norm_share from the medians of the timed steps (the first
    ``timing_warmup`` left out), per framework and mode."""
    config = dataclasses.replace(TINY, timing_warmup=1)

    def run(norm: str, seconds: list[float], framework: str = "torch") -> dict:
        return {"framework": framework, "mode": "eager", "norm": norm, "losses": [3.0, 2.0, 1.0],
                "step_s": seconds}

    runs = [run("own-layer", [9.0, 2.0, 2.0]), run("rms", [9.0, 1.5, 1.5]),
            run(IDENTITY, [9.0, 1.0, 1.0]), run("rms", [9.0, 4.0, 4.0], "flax")]
    results.summarize(runs, config)
    layer, rms, identity, other = runs
    assert layer["median_step_s"] == 2.0 and layer["first_step_s"] == 9.0
    assert rms["vs_layernorm"] == 0.75 and layer["norm_share"] == 0.5
    assert rms["norm_share"] == pytest.approx(1 / 3) and identity["norm_share"] is None
    assert other["vs_layernorm"] is None and other["norm_share"] is None  # no peers there
    assert rms["tokens_per_s"] == config.tokens_per_step / 1.5 and rms["final_loss"] == 1.0


def test_the_task_and_the_schedule():
    config = SIZES["cpu"]
    batch = data.batches(config, steps=3)
    assert batch.inputs.shape == batch.targets.shape == (3, config.batch, config.seq_len)
    sequence = np.concatenate([batch.inputs[..., :1], batch.targets], axis=-1)
    symbols, separator, ordered = np.split(sequence, [config.items, config.items + 1], axis=-1)
    assert (separator == config.symbols).all() and (np.sort(symbols, -1) == ordered).all()
    assert batch.weights.sum() == config.items and batch.weights[config.items:].all()
    assert batch.targets.max() < config.vocab
    rates = [float(config.learning_rate_at(s)) for s in range(config.steps)]
    assert rates[0] == config.learning_rate / config.warmup_steps
    assert rates[config.warmup_steps - 1] == pytest.approx(config.learning_rate)
    assert rates[-1] == pytest.approx(config.learning_rate / 10)
    assert all(a >= b for a, b in zip(rates[config.warmup_steps:], rates[config.warmup_steps + 1:]))


def test_a_config_that_cannot_be_built_is_refused():
    with pytest.raises(ValueError, match="heads"):
        ModelConfig(d_model=30, heads=4)
    with pytest.raises(ValueError, match="timing_warmup"):
        ModelConfig(steps=2, timing_warmup=2)
    with pytest.raises(ValueError, match="unknown norms"):
        model.run(size="tiny", norms=["batch"], progress=False)
    assert cfg.config_from_dict(cfg.config_to_dict(SIZES["gpu"])) == SIZES["gpu"]


def _normkit(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "normkit", "bench", *argv], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=timeout)


@pytest.mark.skipif("torch" not in INSTALLED, reason="torch not installed")
def test_the_command_writes_the_runs_and_both_figures(tmp_path):
    done = _normkit("--model", "--quick", "--backend", "torch", "--mode", "eager", "--norm", "rms",
                    "--json", str(tmp_path / "m.json"), "--plot", str(tmp_path / "m.png"))
    assert done.returncode == 0, done.stderr
    assert "normkit.torch.RMSNorm" in done.stdout and "torch.nn.Identity" in done.stdout
    assert "fewer than two frameworks" in done.stdout
    found = json.loads((tmp_path / "m.json").read_text())
    assert found["benchmark"] == "model" and found["size"] == "tiny"
    assert [(r["norm"], r["mode"]) for r in found["runs"]] == [("rms", "eager"), (IDENTITY, "eager")]
    assert found["machine"]["load_average_start"] and found["machine"]["cores"] >= 1
    assert found["runs"][0]["profiled_norm_share"] is not None
    assert 0 < found["runs"][0]["profiled_norm_share"] < 1
    assert (tmp_path / "m.png").exists() and (tmp_path / "m-loss.png").exists()


def test_options_the_model_benchmark_cannot_take_are_refused():
    done = _normkit("--model", "--dtype", "bfloat16", timeout=120)
    assert done.returncode == 2 and "float32" in done.stderr
    done = _normkit("--model", "--device", "cpu", "--device", "cuda:0", timeout=120)
    assert done.returncode == 2 and "one device" in done.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="a POSIX script")
def test_gpu_check_runs_the_model_benchmark_only_when_asked_within_its_time(tmp_path):
    """scripts/gpu-check's model step, on a fake GPU: `normkit bench --model gpu` on cuda:0,
    Flax first, stopped at its limit with what it wrote recorded; not among the default steps."""
    script = ROOT / "scripts" / "gpu-check"
    stopped = {"interrupted": True, "runs": [{"framework": "flax"}]}
    slow = fake_gpu.install(tmp_path, [(["-m", "bench", "--model"], stopped)])
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(slow)}
    env.pop("OUT", None)
    out = tmp_path / "results"
    done = subprocess.run([sys.executable, str(script), "--only", "model", "--budget", "12",
                           "--out", str(out)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 1, done.stderr
    [record] = json.loads((out / "summary.json").read_text())["steps"]
    assert record["step"] == "model" and record["status"] == "timeout"
    assert record["runs"] == 1 and record["interrupted"] is True and record["seconds"] < 30
    log = (out / "model.log").read_text()
    assert ("normkit bench --model gpu --device cuda:0 --backend jax --backend torch --norm "
            "own-layer --norm own-rms --norm rms --json") in log
    wrong = subprocess.run([sys.executable, str(script), "--only", "everything"],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert wrong.returncode == 2 and "tests, conformance, kernels, bench, model" in wrong.stderr
