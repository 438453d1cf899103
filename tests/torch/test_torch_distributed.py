"""normkit.torch under torch.distributed on 4 CPU ranks (gloo): sequence and tensor parallelism,
FSDP2, DTensor inputs, the sharded normalized axis, and training against one process.

Each group of checks (tests/torch/distributed_checks.py) runs in 4 rank processes started once;
a rank that fails or outlives the deadline stops the group. The single-process error paths of
normkit.torch.distributed are tested here directly.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

from normkit import NormSpec  # noqa: E402
from normkit.torch.distributed import normalize_sharded  # noqa: E402

SCRIPT = pathlib.Path(__file__).with_name("distributed_checks.py")
DOC = pathlib.Path(__file__).parents[2] / "docs" / "distributed.md"
WORLD = 4
DEADLINE_S = 300
MODEL_CHECKS = ("SequenceParallel", "FSDP2", "DTensor batch", "train")


def run_ranks(group: str, logs: pathlib.Path) -> str:
    """Start the 4 ranks of ``group``; rank 0's output once all exit 0, else AssertionError."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    outputs = [logs / f"{group}-rank{rank}.log" for rank in range(WORLD)]
    procs = []
    for rank, out in enumerate(outputs):
        with out.open("w") as f:
            command = [sys.executable, str(SCRIPT), group, str(rank), str(store.port)]
            procs.append(subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + DEADLINE_S
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = [out.read_text() for out in outputs]
    report = "\n".join(f"--- rank {r} (exit {p.returncode})\n{t}" for r, (p, t) in
                       enumerate(zip(procs, texts, strict=True)))
    assert all(p.returncode == 0 for p in procs), report
    return texts[0]


def _passed(output: str) -> list[str]:
    names = re.findall(r"^PASSED (.+?) \(", output, flags=re.MULTILINE)
    summary = re.search(r"^ALL (\d+) CHECKS PASSED$", output, flags=re.MULTILINE)
    assert summary is not None and int(summary.group(1)) == len(names), output
    return names


@pytest.fixture(scope="module")
def passed_checks(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Every check of distributed_checks.py, in one start of the 4 ranks (start-up dominates)."""
    return _passed(run_ranks("all", tmp_path_factory.mktemp("ranks")))


def test_sharded_normalized_axis_every_kind(passed_checks: list[str]) -> None:
    """The statistic all-reduced over the ranks holding a row: forward and gradients."""
    sharded = [name for name in passed_checks if not name.startswith(MODEL_CHECKS)]
    assert len(sharded) == 34, sharded
    for kind in ("rms p=None", "partial_rms p=0.125", "partial_rms p=0.3", "layer p=None"):
        for placement in ("inside", "outside"):
            for dtype in ("float32", "bfloat16"):
                assert f"sharded {kind} {placement} torch.{dtype}" in sharded, sharded


def test_modules_sequence_parallel_fsdp2_and_training(passed_checks: list[str]) -> None:
    """SequenceParallel, DTensor batch shards (DyT and add_norm too), FSDP2, and 5 training steps
    under TP+SP / FSDP2."""
    models = [name for name in passed_checks if name.startswith(MODEL_CHECKS)]
    assert len(models) == 19, models
    assert "DTensor batch sharding DyT" in models and "DTensor batch sharding add_norm" in models
    for module in ("RMSNorm", "PartialRMSNorm", "LayerNorm"):
        for dtype in ("float32", "bfloat16"):
            assert f"SequenceParallel {module} torch.{dtype}" in models, models
            assert f"FSDP2 {module} torch.{dtype}" in models, models
    assert "train 5 steps tp+sp" in models and "train 5 steps fsdp2" in models, models


def test_docs_example_runs_as_pasted(tmp_path: pathlib.Path) -> None:
    """The tensor + sequence parallel example of docs/distributed.md, on 2 CPU ranks.

    A run whose rank aborts at interpreter exit, after all its steps, with torch's gloo
    finalization race (pytorch#190489; docs/distributed.md) is run again, at most twice.
    """
    example = re.search(r"## Example.*?```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert example is not None
    script = tmp_path / "tp_example.py"
    script.write_text(example.group(1))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=DEADLINE_S,
        )
        losses = [float(v) for v in re.findall(r"^step \d: loss ([\d.]+)$", done.stdout,
                                                flags=re.MULTILINE)]
        aborted_at_exit = (len(losses) == 3 and "terminated with signal SIGABRT" in done.stderr
                           and "terminate called without an active exception" in done.stderr)
        if not aborted_at_exit:
            break
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], done.stdout


@pytest.mark.parametrize(
    "spec, field",
    [
        (NormSpec(residual="rounded"), "residual='rounded'"),
        (NormSpec("layer", variance="fast"), "variance='fast'"),
        (NormSpec(scale_offset=1.0, offset_dtype="param"), "offset_dtype='param'"),
        (NormSpec(output_dtype="promote"), "output_dtype='promote'"),
        (NormSpec(backward="autograd"), "backward='autograd'"),
        (NormSpec("dyt"), "kind='dyt'"),
    ],
    ids=str,
)
def test_sharded_normalized_dim_refuses_the_extended_fields(spec: NormSpec, field: str) -> None:
    with pytest.raises(ValueError, match=rf"normalize_sharded \(a sharded normalized dim\) does "
                       rf"not support NormSpec.{field}"):
        normalize_sharded(torch.ones(2, 4), spec)


def test_plain_tensor_needs_torch_distributed_initialized() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="needs torch.distributed initialized"):
        normalize_sharded(torch.ones(2, 4), NormSpec())


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((torch.ones(2, 4, dtype=torch.int32), NormSpec()), TypeError, "x has dtype int32"),
        (("x", NormSpec()), TypeError, "x must be a torch.Tensor, got str"),
        ((torch.ones(2, 4), NormSpec(), torch.ones(3)), ValueError,
         r"weight has shape \(3,\), expected \(4,\)"),
        ((torch.ones(2, 4), NormSpec(scale=False), torch.ones(4)), ValueError,
         "weight was given but the spec has scale=False"),
        ((torch.ones(2, 4), NormSpec(), None, torch.ones(4)), ValueError,
         "bias was given but the spec has bias=False"),
        ((torch.ones(2, 4, 4), NormSpec(kind="partial_rms", p=0.5, axis=(-2, -1))), ValueError,
         "needs a single normalized axis"),
    ],
)
def test_bad_input_is_named(args: tuple, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        normalize_sharded(*args)
