"""Bad invocations, table-driven: each exits 2 with one error line naming the problem, no traceback,
and leaves no output behind (issue 21's contract; the table grows with every refusal we add)."""

from __future__ import annotations

import re
import time

import pytest

from allocmoe.cli import main


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_folder):
    from allocmoe import allocate, load_model

    root = tmp_path_factory.mktemp("contract")
    (root / "a_file").write_text("not a folder")
    (root / "a_dir").mkdir()
    (root / "text.txt").write_text("too short")
    (root / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 500)
    model, _ = load_model(tiny_folder)
    allocate(0.5, "uniform", model=model).save(root / "plan.json")
    return root


def cases(root, model):
    m = ["--model", str(model)]
    out = str(root / "new" / "x.json")
    plan = str(root / "plan.json")
    return [
        # numbers refused by the parser (argparse's own line, exit 2)
        (["profile", *m, "--batch-size", "0", "--output", str(root / "p.json")], "--batch-size: must be above 0"),
        (["profile", *m, "--batch-size", "-3", "--output", str(root / "p.json")], "must be above 0"),
        (["profile", *m, "--batch-size", "2.5", "--output", str(root / "p.json")], "must be a whole number"),
        (["profile", *m, "--calib-tokens", "0", "--output", str(root / "p.json")], "--calib-tokens: must be above 0"),
        (["profile", *m, "--seq-len", "nan", "--output", str(root / "p.json")], "must be a whole number"),
        (["eval", *m, "--eval-tokens", "-1"], "--eval-tokens: must be above 0"),
        (["eval", *m, "--limit", "0"], "--limit: must be above 0"),
        (["eval", *m, "--num-fewshot", "-1"], "--num-fewshot: must be at least 0"),
        (["allocate", *m, "--budget", "0.5", "--method", "alloc-t", "--k-base", "0", "--output", str(root / "p.json")],
         "--k-base: must be above 0"),
        (["bench", *m, "--plan", plan, "--repeats", "0"], "--repeats: must be above 0"),
        (["bench", *m, "--plan", plan, "--input-len", "inf"], "must be a whole number"),
        (["bench", *m, "--plan", plan, "--warmup", "-1"], "--warmup: must be at least 0"),
        (["sweep", *m, "--eval-tokens", "1e9999"], "must be a whole number"),
        # prefixes are not expanded
        (["eval", *m, "--out", str(root / "e.json")], "unrecognized arguments: --out"),
        (["allocate", *m, "--budget", "0.5", "--meth", "uniform", "--output", str(root / "p.json")], "unrecognized"),
        # output paths, before any work
        (["profile", *m, "--output", out], "does not exist"),
        (["profile", *m, "--output", str(root / "a_dir")], "is a folder"),
        (["profile", *m, "--output", str(root / "a_file" / "p.json")], "which is a file"),
        (["allocate", *m, "--budget", "0.5", "--method", "uniform", "--output", out], "does not exist"),
        (["eval", *m, "--output", str(root / "a_dir")], "is a folder"),
        (["sweep", *m, "--output", str(root / "a_file")], "is a file"),
        (["sweep", *m, "--output", str(root / "a_file" / "sweep")], "which is a file"),
        (["analyze", *m, "--plan", plan, "--output", str(root / "a_file")], "is a file"),
        (["bench", *m, "--plan", plan, "--output", str(root / "a_dir")], "is a folder"),
        (["compare", plan, plan, "--output", out], "does not exist"),
        # lengths past the model's context (the tiny model has 256 positions)
        (["eval", *m, "--seq-len", "4096"], "outside this model's context of 1..256"),
        (["profile", *m, "--seq-len", "257", "--output", str(root / "p.json")], "outside this model's context"),
        # inputs
        (["eval", *m, "--text", str(root / "missing.txt")], "not found"),
        (["eval", *m, "--plan", str(root / "missing.json")], "not found"),
        (["profile", *m, "--calib-text", str(root / "latin1.txt"), "--output", str(root / "p.json")], "UTF-8"),
        (["eval", "--model", str(root / "a_dir")], "config"),
    ]


def test_every_bad_invocation_is_one_clear_line_and_exit_2(files, tiny_folder, capsys):
    table = cases(files, tiny_folder)
    assert len(table) >= 30
    before = set(files.rglob("*"))
    for argv, message in table:
        start = time.monotonic()
        with pytest.raises(SystemExit) as exc:
            main(argv)
            pytest.fail(f"accepted: {argv}")
        err = capsys.readouterr().err
        lines = [line for line in err.replace("\r", "\n").strip().splitlines()      # without usage and bars
                 if line.strip() and not line.startswith(("usage:", " ")) and not re.search(r"\| *\d+/\d+ \[", line)]
        assert exc.value.code == 2, (argv, err)
        assert "Traceback" not in err and len(lines) == 1, (argv, err)
        assert message in lines[0], (argv, lines[0])
        assert time.monotonic() - start < 20, argv
    assert set(files.rglob("*")) == before            # nothing written, nothing half-written
