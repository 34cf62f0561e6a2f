"""Outputs and input files (issue 39, "trust at every door"): no command writes over one of its own
inputs (through a link, a hard link or a plan's means file), or over anything that is not absent or a
regular file (a device, a FIFO, a socket), and a name the system cannot take is one line, exit 2.
Every refusal comes before any forward pass and before the weights load, leaves every input byte for
byte as it was, and writes nothing. An input that is a FIFO is refused without opening it (never a hang)."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
from pathlib import Path

import pytest

from allocmoe import AllocMoeError, Plan
from allocmoe.cli import main


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_folder):
    from allocmoe import allocate, load_model
    from allocmoe.core.files import atomic_write_json
    from allocmoe.routing.layout import model_fingerprint

    root = tmp_path_factory.mktemp("outputs")
    model, _ = load_model(tiny_folder)
    allocate(0.5, "uniform", model=model).save(root / "plan.json")
    fp = model_fingerprint(model)
    k, layers = fp["k_orig"], fp["num_moe_layers"]
    atomic_write_json(root / "profile.json", {
        "format_version": 1, "model": fp, "k_orig": k, "num_layers": layers, "metric": "perplexity",
        "calibration": {"text": "x", "sha256": "0" * 16, "tokens_scored": 64, "windows": 4, "seq_len": 16,
                        "max_tokens": 64, "batch_size": 4},
        "sensitivity": [[10.0 - j for j in range(k)] for _ in range(layers)]})
    (root / "text.txt").write_text("the king said to the queen that the day was long. " * 200)
    (root / "plan.means.safetensors").write_bytes(b"not really means, but an input all the same")
    (root / "eval.json").write_text(json.dumps({"perplexity": 3.0}))
    (root / "out").mkdir()
    (root / "out" / "analysis.json").write_text("an input that happens to lie where analyze writes")
    (root / "out" / "results.json").write_text("an input that happens to lie where sweep writes")
    os.symlink(root / "plan.json", root / "link_to_plan.json")
    os.symlink(root / "profile.json", root / "link_to_profile.json")
    os.link(root / "plan.json", root / "hard_plan.json")
    os.mkfifo(root / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "sock"))
    yield root
    sock.close()


def _snapshot(*folders) -> dict:
    """Every entry's type, and every regular file's bytes (FIFOs and sockets are never opened)."""
    state = {}
    for folder in folders:
        for path in sorted(Path(folder).rglob("*")):
            mode = os.lstat(path).st_mode
            state[path] = (stat.S_IFMT(mode), path.read_bytes() if stat.S_ISREG(mode) else None)
    return state


@pytest.fixture(autouse=True)
def no_special_file_replaced(monkeypatch):
    """A regression must fail here, not replace /dev/null as root: os.replace over anything but a
    regular file (or a folder by a folder) is an assertion."""
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if os.path.exists(dst) and not os.path.isfile(dst) and not os.path.isdir(src):
            raise AssertionError(f"about to replace {dst}, which is not a regular file")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)


def _refused(argv, message, folders, capsys, counted):
    before = _snapshot(*folders)
    previous = signal.signal(signal.SIGALRM, lambda *a: pytest.fail(f"hung: {argv}"))
    signal.alarm(60)                                  # an input FIFO opened for reading would block forever
    try:
        with pytest.raises(SystemExit) as exc:
            main([str(a) for a in argv])
            pytest.fail(f"accepted: {argv}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip() and not line.startswith(("usage:", " "))]
    assert exc.value.code == 2, (argv, err)
    assert "Traceback" not in err and len(lines) == 1, (argv, err)
    assert lines[0].startswith("allocmoe: error: ") and message in lines[0], (argv, lines[0])
    assert "; " in lines[0], lines[0]
    assert counted == {"forward": 0, "loads": 0}, (argv, counted)
    assert _snapshot(*folders) == before, f"changed or written: {argv}"


def same_file_cases(r: Path, model: Path):
    m = ["--model", model]
    plan, profile, text = r / "plan.json", r / "profile.json", r / "text.txt"
    A = ["allocate", *m, "--method", "alloc-l", "--budget", "0.5"]
    also = "is also an input"
    return [
        ([*A, "--profile", profile, "--output", profile], also + " (--profile"),
        ([*A, "--profile", profile, "--output", r / "link_to_profile.json"], also + " (--profile"),
        ([*A, "--profile", r / "link_to_profile.json", "--output", profile], also + " (--profile"),
        (["allocate", *m, "--method", "auto", "--budget", "0.5", "--profile", profile, "--calib-text", text,
          "--output", text], also + " (--calib-text"),
        # the means file `allocate --output text.json` would write beside the plan is an input
        ([*A, "--profile", profile, "--calib-text", r / "plan.means.safetensors", "--output", plan],
         "also writes"),
        (["profile", *m, "--calib-text", text, "--output", text], also + " (--calib-text"),
        (["eval", *m, "--plan", plan, "--output", plan], also + " (--plan"),
        (["eval", *m, "--plan", plan, "--output", r / "link_to_plan.json"], also + " (--plan"),
        (["eval", *m, "--plan", plan, "--output", r / "hard_plan.json"], also + " (--plan"),
        (["eval", *m, "--plan", plan, "--output", r / "plan.means.safetensors"], also + " (--plan's means file"),
        (["eval", *m, "--text", text, "--output", text], also + " (--text"),
        (["eval", *m, "--output", model / "config.json"], "inside an input folder (--model"),
        (["bench", *m, "--plan", plan, "--input-len", "16", "--output-len", "4", "--output", plan],
         also + " (--plan"),
        (["export", "--format", "vllm", "--plan", plan, "--output", plan], also + " (--plan"),
        (["export", "--format", "vllm", "--request-plan", f"a={plan}", "--output", r / "hard_plan.json"],
         also + " (--request-plan"),
        (["compare", r / "eval.json", plan, "--output", r / "eval.json"], also + " (A "),
        (["compare", plan, r / "eval.json", "--output", r / "eval.json"], also + " (B "),
        (["analyze", *m, "--plan", plan, "--text", r / "out" / "analysis.json", "--output", r / "out"],
         also + " (--text"),
        (["sweep", *m, "--profile", r / "out" / "results.json", "--output", r / "out"], also + " (--profile"),
        (["sweep", *m, "--output", model], "is also an input folder (--model"),
    ]


SAME = same_file_cases(Path("R"), Path("M"))


@pytest.mark.parametrize("index", range(len(SAME)), ids=[" ".join(str(a).replace("R/", "") for a in argv
                                                                 if str(a) not in ("M", "--model"))[:70]
                                                        for argv, _ in SAME])
def test_an_output_that_is_one_of_the_commands_inputs_is_refused(index, inputs, tiny_folder, capsys, counted):
    argv, message = same_file_cases(inputs, tiny_folder)[index]
    _refused(argv, message, (inputs, tiny_folder), capsys, counted)


def _commands(r: Path, model: Path, output) -> list[list]:
    m = ["--model", model]
    plan = r / "plan.json"
    return [
        ["profile", *m, "--output", output],
        ["allocate", *m, "--method", "uniform", "--budget", "0.5", "--output", output],
        ["eval", *m, "--plan", plan, "--output", output],
        ["bench", *m, "--plan", plan, "--input-len", "16", "--output-len", "4", "--output", output],
        ["export", "--format", "vllm", "--plan", plan, "--output", output],
        ["compare", r / "eval.json", r / "eval.json", "--output", output],
        ["sweep", *m, "--output", output],
        ["analyze", *m, "--plan", plan, "--output", output],
    ]


@pytest.mark.parametrize("target,message", [
    ("/dev/null", "is a device"), ("fifo", "is a FIFO"), ("sock", "is a socket"), ("", "is an empty path"),
    ("x" * 300 + ".json", "too long"), ("a/" * 3000 + "x.json", "too long")])
@pytest.mark.parametrize("command", range(8), ids=["profile", "allocate", "eval", "bench", "export", "compare",
                                                   "sweep", "analyze"])
def test_an_output_that_is_not_a_regular_file_or_folder_is_refused(command, target, message, inputs, tiny_folder,
                                                                    capsys, counted):
    output = target if target in ("/dev/null", "") or target.startswith(("x", "a/")) else inputs / target
    argv = _commands(inputs, tiny_folder, output)[command]
    if argv[0] in ("sweep", "analyze") and target == "/dev/null":
        message = "is a device; give a folder path"
    _refused(argv, message, (inputs, tiny_folder), capsys, counted)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("argv,message", [
    (["eval", "--plan", "{fifo}"], "is a FIFO (named pipe), not a regular file"),
    (["eval", "--text", "{fifo}"], "is a FIFO (named pipe), not a regular file"),
    (["allocate", "--method", "alloc-l", "--budget", "0.5", "--profile", "{fifo}", "--output", "{new}"],
     "is a FIFO (named pipe), not a regular file"),
    (["profile", "--calib-text", "/dev/zero", "--output", "{new}"], "is a device, not a regular file"),
    (["generate", "--plan", "{sock}", "--prompt", "hi"], "is a socket, not a regular file"),
    (["compare", "{fifo}", "{fifo}"], "is a FIFO"),
    (["eval", "--plan", "p" * 300], "too long"),
])
def test_an_input_that_is_not_a_regular_file_is_refused_without_opening_it(argv, message, inputs, tiny_folder,
                                                                             tmp_path, capsys, counted):
    names = {"fifo": inputs / "fifo", "sock": inputs / "sock", "new": tmp_path / "new.json"}
    argv = [a.format(**names) for a in argv]
    argv = [argv[0], "--model", str(tiny_folder), *argv[1:]] if argv[0] != "compare" else argv
    _refused(argv, message, (inputs, tiny_folder, tmp_path), capsys, counted)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_output_in_a_read_only_folder_is_refused_before_any_work(inputs, tiny_folder, tmp_path, capsys, counted):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        _refused(["profile", "--model", tiny_folder, "--output", locked / "p.json"], "is not writable",
                 (inputs, tiny_folder, tmp_path), capsys, counted)
    finally:
        locked.chmod(0o755)


def test_the_library_never_replaces_a_device_fifo_or_folder(inputs, tmp_path, counted):
    """The last line of defence, under every command and the Python API: the atomic write itself."""
    from allocmoe.core.files import atomic_write_bytes, atomic_write_json

    plan = Plan.load(inputs / "plan.json")
    for target, message in (("/dev/null", "is a device"), (inputs / "fifo", "is a FIFO"),
                            (inputs / "sock", "is a socket"), (tmp_path, "is a folder")):
        with pytest.raises(AllocMoeError, match=message):
            atomic_write_bytes(target, b"x")
        with pytest.raises(AllocMoeError, match=message):
            atomic_write_json(target, {})
        with pytest.raises(AllocMoeError, match=message):
            plan.save(target)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and stat.S_ISFIFO(os.stat(inputs / "fifo").st_mode)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(AllocMoeError, match="is a FIFO"):
        Plan.load(inputs / "fifo")
    with pytest.raises(AllocMoeError, match="too long"):
        Plan.load("p" * 300)


def test_a_good_output_beside_its_inputs_is_still_written(inputs, tiny_folder, tmp_path):
    """The checks refuse only what they should: a new file next to the inputs, and an existing regular
    output file (replaced atomically, never truncated first) are written."""
    out = tmp_path / "eval.json"
    out.write_text("old")
    main(["export", "--format", "vllm", "--plan", str(inputs / "plan.json"), "--output", str(out)])
    assert "allocmoe" in out.read_text() and sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]


def test_odd_output_names_stay_one_line_and_the_built_in_files_are_inputs(inputs, tiny_folder, tmp_path, capsys,
                                                                          counted):
    """A newline in a path must not break the one-line rule; a trailing slash names a folder; the
    built-in model, texts and tasks inside the package are inputs of every command (the default --model)."""
    from allocmoe.models import BUILTIN_MODEL

    folders = (inputs, tiny_folder, tmp_path)
    _refused(["eval", "--model", tiny_folder, "--output", tmp_path / "no\nsuch" / "x.json"], "does not exist",
             folders, capsys, counted)
    _refused(["eval", "--model", tiny_folder, "--output", f"{tmp_path}/new/"], "ends with a slash", folders, capsys,
             counted)
    _refused(["eval", "--output", BUILTIN_MODEL / "config.json"], "allocmoe's built-in files", folders, capsys,
             counted)
    _refused(["sweep", "--output", BUILTIN_MODEL.parent], "is also an input folder (allocmoe's built-in files",
             folders, capsys, counted)
    _refused(["profile", "--model", tiny_folder, "--output", tmp_path / ("y" * 250 + ".json")],
             "partial.json: File name too long", folders, capsys, counted)     # its resume file: a name too long


@pytest.mark.parametrize("text", ["1_0", " 4", "4 ", "٤", "４", "+4", "0x4", "4.0", "9" * 40])
def test_whole_number_flags_are_ascii_digits_only(text):
    """--batch-size, --calib-tokens, --seq-len, ...: int() would take "1_0", spaces and any Unicode digit."""
    import argparse

    from allocmoe.cli.common import non_negative_int, positive_int

    for read in (positive_int, non_negative_int):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a whole number"):
            read(text)
    assert positive_int("4") == 4 and non_negative_int("0") == 0 and positive_int("0010") == 10


def test_a_long_but_valid_output_name_is_written(inputs, tmp_path):
    """250 bytes is a valid name, but the temporary file beside it once took the name plus 14 bytes:
    the write failed at the very end (exit 1), after all the work."""
    out = tmp_path / ("z" * 250)
    main(["export", "--format", "vllm", "--plan", str(inputs / "plan.json"), "--output", str(out)])
    assert out.is_file() and [p.name for p in tmp_path.iterdir()] == [out.name]


def test_a_folder_output_name_too_long_for_its_temporary_folder_is_refused_first(inputs, tiny_folder, tmp_path,
                                                                                 capsys, counted):
    _refused(["sweep", "--model", tiny_folder, "--output", tmp_path / ("s" * 240)], "give a shorter name",
             (inputs, tiny_folder, tmp_path), capsys, counted)
