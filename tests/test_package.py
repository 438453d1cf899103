"""The package as users meet it: a light import, the CLI, backend discovery."""

import json
import subprocess
import sys

import pytest

import normkit
from normkit import backends, cli


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_import_normkit_imports_numpy_and_ml_dtypes_only():
    """``import normkit`` stays light: besides the standard library it loads numpy and
    ml_dtypes, no framework and no harness dependency (rich, matplotlib). Counted in modules,
    not seconds: a timing would measure the machine."""
    out = run_python(
        "import sys; before = set(sys.modules); import normkit\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(sorted(new - set(sys.stdlib_module_names)))"
    )
    assert out == "['ml_dtypes', 'normkit', 'numpy']"


def test_public_api():
    assert normkit.NormSpec is normkit.spec.NormSpec
    assert callable(normkit.reference.normalize) and callable(normkit.reference.normalize_vjp)
    assert callable(normkit.tolerances.measure)


def test_python_m_normkit_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "normkit", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"normkit {normkit.__version__}"


def test_info_json_lists_every_backend_without_importing_it(capsys):
    assert cli.main(["info", "--json", "--no-devices"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["normkit"] == normkit.__version__
    assert [b["backend"] for b in report["backends"]] == ["torch", "tf", "jax"]
    for row in report["backends"]:
        assert row["install"] == f"pip install 'normkit[{row['backend']}]'"
        complete = all(v is not None for v in row["versions"].values())
        assert row["installed"] == complete or "via" in row


def test_info_names_the_extra_for_a_missing_backend(capsys, monkeypatch):
    fake = backends.Backend("fake", "normkit.fake", "fake", ("no_such_package_xyz",), "print('[]')")
    monkeypatch.setattr(backends, "BACKENDS", (fake,))
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "normkit.fake  not installed (no_such_package_xyz -); pip install 'normkit[fake]'" in out


def test_info_reports_keras_on_another_backend_without_tensorflow(capsys, monkeypatch):
    """With keras and jax but no tensorflow, normkit.tf is usable as Keras on JAX."""
    find_spec = backends.importlib.util.find_spec
    monkeypatch.setattr(
        backends.importlib.util, "find_spec",
        lambda name, *a: None if name == "tensorflow" else find_spec(name, *a),
    )
    version = backends.importlib.metadata.version

    def hidden(name):
        if name == "tensorflow":
            raise backends.importlib.metadata.PackageNotFoundError(name)
        return version(name)

    monkeypatch.setattr(backends.importlib.metadata, "version", hidden)
    monkeypatch.setattr(backends, "BACKENDS", (backends.get("tf"),))
    assert cli.main(["info", "--no-devices"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("  normkit.tf    tensorflow -, keras ")
    assert line.endswith("; usable as Keras on JAX (KERAS_BACKEND=jax)")
    assert cli.main(["info", "--json", "--no-devices"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["backends"]
    assert row["installed"] and row["via"] == "Keras on JAX" and row["env"] == {"KERAS_BACKEND": "jax"}


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="unknown backend 'mxnet'"):
        backends.get("mxnet")


def test_device_probe_failure_is_reported():
    broken = backends.Backend("broken", "normkit.broken", "x", (), "NoSuchBridge")
    with pytest.raises(RuntimeError, match="broken: listing devices failed: AttributeError: .*NoSuchBridge"):
        broken.devices()


def test_reference_command_prints_the_cast_emulation(capsys):
    args = ["reference", "1", "7", "--dtype", "bfloat16", "--eps", "1e-12", "--scale", "1.0078125", "1.0078125"]
    assert cli.main([*args, "--cast", "before_scale"]) == 0
    assert "y        = [0.202148, 1.40625]  (bfloat16)" in capsys.readouterr().out


def test_cli_reports_invalid_spec_as_an_error(capsys):
    assert cli.main(["reference", "1", "2", "--p", "0.5"]) == 2
    assert "normkit reference: error: NormSpec.p=0.5 is invalid" in capsys.readouterr().err


def test_every_subcommand_is_registered_with_help(capsys):
    names = [name for name, _, _ in cli.COMMANDS]
    assert names == ["bench", "conformance", "doctor", "identify", "info", "port", "reference",
                     "warmup"]
    for name in names:
        with pytest.raises(SystemExit) as done:
            cli.main([name, "--help"])
        assert done.value.code == 0
        assert cli.HELP[name].split()[0] in capsys.readouterr().out
