"""axis_name: sharded (shard_map over 4 CPU devices) equals unsharded, forward and gradients.

The device count is fixed when JAX starts, so the checks run in a subprocess
(tests/jax_sharded_checks.py) with XLA_FLAGS=--xla_force_host_platform_device_count=4.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("jax")

SCRIPT = pathlib.Path(__file__).with_name("jax_sharded_checks.py")


def test_sharded_equals_unsharded_on_four_cpu_devices() -> None:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    passed = re.findall(r"^PASSED ", done.stdout, flags=re.MULTILINE)
    summary = re.search(r"^ALL (\d+) CHECKS PASSED$", done.stdout, flags=re.MULTILINE)
    assert summary is not None, done.stdout
    assert int(summary.group(1)) == len(passed) == 25, done.stdout
