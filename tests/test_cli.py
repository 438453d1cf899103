"""The command line never hangs or lies: exit status 0 only when a check ran and none failed, 1
when a check failed or none ran, 2 for a usage error; every error one line, never a traceback."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from normkit import NormSpec, arguments, cli, port
from normkit.conformance import runner
from normkit.conformance.cases import matrix
from normkit.conformance.targets import TARGETS, select


def one_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The single stderr line of a failed command (besides progress lines), without its prefix."""
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith(("conformance: ", "bench: "))]
    assert len(err) == 1, err
    prefix = f"normkit {command}: error: "
    assert err[0].startswith(prefix), err
    return err[0][len(prefix):]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["conformance", "--backend", "to"], "unknown backends ['to']; known: ['torch', "),
        (["conformance", "--backend", "tf[jax"], "unknown backends ['tf[jax']"),
        (["conformance", "--jobs", "0"], "argument --jobs: must be at least 1, got 0"),
        (["conformance", "--jobs", "-1"], "argument --jobs: must be at least 1, got -1"),
        (["conformance", "--device", "bogus"], "argument --device: 'bogus' is not a device name"),
        (
            ["conformance", "--json", "/nonexistent/x.json"],
            "argument --json: cannot write /nonexistent/x.json: the folder /nonexistent does not "
            "exist",
        ),
        (
            ["conformance", "--json", "-", "--markdown", "-"],
            "--json and --markdown cannot both write to stdout",
        ),
        (["identify", "torch.nn.RMSNorm", "--n", "-5"], "argument --n: must be at least 2, got -5"),
        (
            ["identify", "torch.nn.RMSNorm", "--device", "bogus"],
            "argument --device: 'bogus' is not a device name: expected cpu, cuda:N (alias gpu:N)",
        ),
        (["bench", "--json", "/nonexistent/x.json"], "argument --json: cannot write /nonexistent"),
        (["bench", "--device", "gpu0"], "argument --device: 'gpu0' is not a device name"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        code = cli.main(argv)
        raise SystemExit(code)
    assert exited.value.code == 2
    assert one_error(capsys, argv[0]).startswith(message)


def test_a_bracketed_target_with_a_comma_is_one_name():
    assert arguments.names("tf[jax,jit],torch") == ["tf[jax,jit]", "torch"]
    assert [t.name for t in select(arguments.names("tf[jax,jit]"))] == ["tf[jax,jit]"]
    assert [t.name for t in select(["tf"])] == [t.name for t in TARGETS if t.name.startswith("tf[")]


@pytest.mark.parametrize(("flags", "cases"), [([], 124), (["--full"], 1131)])
def test_conformance_runs_the_default_matrix_unless_full(monkeypatch, capsys, flags, cases):
    """The main job answers in minutes: the default matrix touches every kind, option and dtype
    (124 cases a target); --full runs all 1131 (the number its help gives)."""
    counts = []

    def run(targets, cases_for, **kwargs):
        counts.extend(len(cases_for(t)) for t in targets)
        return runner.Report([], {}, {})

    monkeypatch.setattr(runner, "run", run)
    assert cli.main(["conformance", "--backend", "torch[composite]", *flags]) == 1
    assert counts == [cases]
    assert len(matrix(quick=not flags)) == cases
    assert f"{len(matrix())} cases per target" in " ".join(
        cli.build_parser().commands["conformance"].format_help().split()
    )


def test_conformance_accepts_every_target_the_help_lists(monkeypatch, capsys):
    chosen = []

    def run(targets, cases_for, **kwargs):
        chosen.extend(t.name for t in targets)
        return runner.Report([], {}, {})

    monkeypatch.setattr(runner, "run", run)
    assert cli.main(["conformance", "--backend", "tf[jax,jit]"]) == 1  # nothing ran: not a pass
    assert chosen == ["tf[jax,jit]"]
    assert one_error(capsys, "conformance") == "no case ran: no target selected"


def test_nothing_installed_is_not_a_pass(monkeypatch, capsys):
    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else found(name, *a)
    )
    assert cli.main(["conformance", "--backend", "torch[composite]"]) == 1
    assert one_error(capsys, "conformance") == (
        "no case ran: torch[composite]: torch not installed (pip install 'normkit[torch]')"
    )


def test_a_device_no_backend_sees_is_not_a_pass(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU")
    argv = [
        "conformance",
        "--backend",
        "torch",
        "--device",
        "cuda:0",
        "--kind",
        "rms",
        "--dtype",
        "float32",
        "--no-pairwise",
    ]
    assert cli.main(argv) == 1
    assert one_error(capsys, "conformance").startswith(
        "no case ran: torch: device cuda:0 not present (['cpu'])"
    )


def test_json_to_stdout_leaves_stdout_to_the_json(monkeypatch, capsys, tmp_path):
    from normkit.conformance.result import Result

    case = matrix(quick=True)[0]
    report = runner.Report([Result("torch", "cpu", case, "PASS")], {}, {"torch": ["cpu"]})
    monkeypatch.setattr(runner, "run", lambda *a, **k: report)
    assert cli.main(["conformance", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert [c["status"] for c in json.loads(out)["cases"]] == ["PASS"]
    assert "1 passed, 0 failed" in err


def test_identify_on_a_device_the_framework_lacks(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU")
    assert cli.main(["identify", "torch.nn.RMSNorm", "--device", "cuda:0"]) == 2
    assert one_error(capsys, "identify") == "device cuda:0 is not one torch sees: ['cpu']"


@pytest.fixture
def norms_file(tmp_path):
    pytest.importorskip("safetensors")
    layers = {"a": ({"weight": np.ones(4, np.float32)}, NormSpec("rms"))}
    return port.save_norms(tmp_path / "ok.safetensors", layers, convention="torch")


def test_port_errors(norms_file, tmp_path, capsys):
    tampered = tmp_path / "tampered.safetensors"
    data = bytearray(norms_file.read_bytes())
    data[20] ^= 0xFF
    tampered.write_bytes(bytes(data))
    out = str(tmp_path / "out.safetensors")
    cases = [
        ([str(tmp_path / "missing.safetensors"), out], "argument SRC: ", "does not exist"),
        ([str(tmp_path), out], "argument SRC: ", "is a directory, not a file"),
        ([str(tampered), out], str(tampered), "is not a readable safetensors file"),
        (
            [str(norms_file), str(tmp_path / "nodir" / "out.st")],
            "argument DST: cannot write",
            "the folder " + str(tmp_path / "nodir") + " does not exist",
        ),
    ]
    for paths, start, end in cases:
        try:
            code = cli.main(["port", *paths, "--to", "flax"])
        except SystemExit as exited:
            code = exited.code
        assert code == 2, paths
        message = one_error(capsys, "port")
        assert message.startswith(start) and end in message, message


def test_port_still_writes(norms_file, tmp_path, capsys):
    assert cli.main(["port", str(norms_file), str(tmp_path / "out.npz"), "--to", "flax"]) == 0
    assert "1 norm layer(s), flax convention" in capsys.readouterr().out


def test_device_names_are_one_scheme():
    from normkit.backends import device_name

    assert [device_name(d) for d in ("cpu", "CPU:0", "gpu:1", "cuda", "gpu", "tpu:2", "mps")] == [
        "cpu",
        "cpu",
        "cuda:1",
        "cuda:0",
        "cuda:0",
        "tpu:2",
        "mps",
    ]
    for bad in ("cpu:1", "gpu0", "cuda:x", "npu:0"):
        with pytest.raises(ValueError, match="is not a device name"):
            device_name(bad)


def test_the_entry_point_prints_no_traceback():
    done = subprocess.run(
        [sys.executable, "-m", "normkit", "conformance", "--jobs", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr == "normkit conformance: error: argument --jobs: must be at least 1, got 0\n"


def test_rich_is_imported_only_to_draw_progress():
    code = (
        "import sys, normkit, normkit.cli, normkit.conformance, normkit.bench, normkit.progress\n"
        "print('rich' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["conformance", "--backend", ""], "argument --backend: '' names nothing"),
        (["conformance", "--backend", " , "], "argument --backend: ' , ' names nothing"),
        (["conformance", "--kind", ""], "argument --kind: '' names nothing"),
        (["conformance", "--dtype", ""], "argument --dtype: '' names nothing"),
        (["conformance", "--device", ""], "argument --device: '' names nothing"),
        (["conformance", "--backend", "torch,"],
         "argument --backend: 'torch,' has an empty name between its commas"),
        (["conformance", "--kind", "rms,,layer"],
         "argument --kind: 'rms,,layer' has an empty name between its commas"),
        (["bench", "--device", ""], "argument --device: '' is not a device name"),
        (["bench", "--backend", ""], "argument --backend: invalid choice: ''"),
        (["bench", "--dtype", ""], "argument --dtype: invalid choice: ''"),
    ],
)
def test_a_filter_that_names_nothing_is_a_usage_error(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(runner, "run", lambda *a, **k: pytest.fail("a case ran"))
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert one_error(capsys, argv[0]).startswith(message)


def test_an_empty_selection_selects_nothing_in_the_library_too(monkeypatch):
    from normkit import conformance

    monkeypatch.setattr(runner, "run", lambda *a, **k: pytest.fail("a case ran"))
    with pytest.raises(ValueError, match="an empty list of backends selects no target"):
        select([])
    for empty in ({"backends": []}, {"backends": [], "peers": True}, {"kinds": ()},
                  {"dtypes": []}, {"devices": []}):
        with pytest.raises(ValueError, match="selects no|selects nothing"):
            conformance.run(**empty)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this platform")
@pytest.mark.parametrize("option", [["conformance", "--json"], ["conformance", "--markdown"],
                                    ["bench", "--json"], ["bench", "--plot"]])
def test_a_report_is_never_written_into_a_named_pipe_or_a_device(
    option, tmp_path, monkeypatch, capsys
):
    import normkit.bench

    monkeypatch.setattr(runner, "run", lambda *a, **k: pytest.fail("a case ran"))
    monkeypatch.setattr(normkit.bench, "run", lambda *a, **k: pytest.fail("a benchmark ran"))
    fifo = tmp_path / "report"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to("/dev/zero")
    for path, kind in ((fifo, "a named pipe (FIFO)"), (link, "a character device")):
        with pytest.raises(SystemExit) as exited:
            cli.main([*option, str(path)])
        assert exited.value.code == 2
        assert one_error(capsys, option[0]) == (
            f"argument {option[1]}: {path} is {kind}, not a regular file"
        )


# A report written under a 64-byte file-size limit fails part-way, as on a full disk.
INTERRUPTED_REPORT = """
import resource, sys
from normkit import arguments

resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))
arguments.write_text(sys.argv[1], "x" * 4096)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file-size limits")
def test_an_interrupted_report_leaves_the_old_report_intact(tmp_path):
    report = tmp_path / "conformance.json"
    old = json.dumps({"cases": [{"status": "PASS"}] * 8})
    report.write_text(old)
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_REPORT, str(report)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "File too large" in done.stderr, done.stderr
    assert report.read_text() == old
    assert [p.name for p in tmp_path.iterdir()] == [report.name]


def test_a_terminated_conformance_run_writes_the_cases_that_finished(monkeypatch, capsys, tmp_path):
    """SIGTERM (a time limit's kill) mid-matrix: the cases that finished are shown and written,
    the JSON says ``interrupted``, no worker is left running, the status is 130, and SIGTERM's
    handler is put back."""
    import signal

    from normkit import workers
    from normkit.conformance.result import Result

    pytest.importorskip("torch")
    made = Result.from_dict
    seen = []

    def from_dict(event):
        seen.append(event)
        if len(seen) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # its handler raises in the runner's loop
        return made(event)

    monkeypatch.setattr(runner.Result, "from_dict", staticmethod(from_dict))
    before = signal.getsignal(signal.SIGTERM)
    report, markdown = tmp_path / "conformance.json", tmp_path / "conformance.md"
    argv = ["conformance", "--backend", "torch[composite]", "--kind", "rms,layer", "--json",
            str(report), "--markdown", str(markdown)]
    assert cli.main(argv) == 130
    assert "2 case runs in" in markdown.read_text()
    assert "interrupted before the end of the matrix." in markdown.read_text()
    assert signal.getsignal(signal.SIGTERM) is before
    assert one_error(capsys, "conformance") == (
        "interrupted: the report holds the cases that finished")
    found = json.loads(report.read_text())
    planned = len(matrix(quick=True, kinds=("rms", "layer")))
    assert found["interrupted"] is True and found["pairwise"] == []
    assert len(found["cases"]) == 2 < planned  # the third was being read when SIGTERM came
    assert all(case["status"] in ("PASS", "SKIP") for case in found["cases"])
    assert not workers._running


# ---- every subcommand's own errors and help ------------------------------------------------


@pytest.mark.parametrize("command", [name for name, _, _ in cli.COMMANDS])
def test_an_unknown_option_is_the_subcommands_error(command, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([command, "--bogus"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"normkit {command}: error: ")
    assert "--bogus" in err[-1] or "required" in err[-1]


def test_every_option_of_reference_says_what_it_is_and_its_default():
    parser = cli.build_parser().commands["reference"]
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, action.dest
            assert "default" in action.help or action.dest == "p", action.dest


def test_reference_prints_dyt_and_readable_gradients(capsys):
    assert cli.main(["reference", "1", "7", "--dtype", "bfloat16", "--cast", "before_scale"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "NormSpec('rms', cast='before_scale')"
    assert out[3] == "d sum(y) / dx = [0.168, -0.024]  (float64)"  # the exact gradient, %g
    assert cli.main(["reference", "0.5", "-2", "--kind", "dyt", "--alpha-init", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "NormSpec('dyt', bias=False, alpha_init=1.0)"
    assert out[2] == f"y        = [{np.tanh(0.5):g}, {np.tanh(-2.0):g}]  (float64)"
    assert cli.main(["reference", "1", "2", "--kind", "dyt", "--eps", "1e-5"]) == 2
    assert "--kind dyt has no statistic" in capsys.readouterr().err


def test_identify_takes_your_own_function(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    (tmp_path / "my_norms.py").write_text(
        "import torch\n\n"
        "def t5(x):  # eps outside the square root\n"
        "    h = x.float()\n"
        "    return (h / (h.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6)).to(x.dtype)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["identify", "my_norms:t5", "--n", "16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["my_norms:t5 (size 16, torch) behaves as:",
                       "NormSpec('rms', eps_placement='outside')"]
    assert cli.main(["identify", "my_norms:nothing"]) == 2
    assert "my_norms has no attribute 'nothing'" in capsys.readouterr().err
    assert cli.main(["identify", "torch.nn:RMSNorm", "--n", "16"]) == 0  # a layer class
    assert capsys.readouterr().out.splitlines()[1] == "NormSpec('rms', eps=1.19209e-07)"


def test_port_keeps_the_files_convention_without_to(norms_file, tmp_path, capsys):
    out = tmp_path / "out.npz"
    assert cli.main(["port", str(norms_file), str(out)]) == 0
    assert "1 norm layer(s), torch convention" in capsys.readouterr().out
    assert port.files.stored_convention(out) == "torch"
    params, _ = port.load_norms(out, to="torch")["a"]
    assert list(params) == ["weight"]
