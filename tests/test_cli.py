"""The CLI end to end on a tiny model folder, and its one-line errors for bad input."""

import json
import subprocess
import sys

import pytest

from allocmoe.cli import main


def expect_error(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2
    assert err[-1].startswith("allocmoe: error: ") and message in err[-1], err[-1]
    assert "Traceback" not in "\n".join(err)


@pytest.fixture(scope="module")
def profile_file(tiny_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("prof") / "profile.json"
    main(["profile", "--model", str(tiny_folder), "--calib-tokens", "512", "--seq-len", "32", "--output", str(out)])
    return out


def test_profile_allocate_eval_round_trip(tiny_folder, profile_file, tmp_path, capsys):
    profile = json.loads(profile_file.read_text())
    assert profile["metric"] == "perplexity" and len(profile["sensitivity"]) == profile["num_layers"] == 3
    plan = tmp_path / "plan.json"
    main(["allocate", "--model", str(tiny_folder), "--profile", str(profile_file), "--budget", "0.5",
          "--method", "alloc-moe", "--output", str(plan)])
    data = json.loads(plan.read_text())
    assert data["format_version"] == 1 and data["budget"] == {"activations_per_token": 6.0, "full": 12, "fraction": 0.5}
    assert set(data["layers"]) == {"1", "2", "3"} and all(e["policy"] == "alloc-t" for e in data["layers"].values())
    capsys.readouterr()
    out_json = tmp_path / "eval.json"
    main(["eval", "--model", str(tiny_folder), "--plan", str(plan), "--eval-tokens", "512", "--seq-len", "32",
          "--output", str(out_json)])
    result = json.loads(out_json.read_text())
    assert result == json.loads(capsys.readouterr().out)
    assert result["full_activations_per_token"] == 12 and result["activations_per_token"] <= 6 + 1e-9
    assert result["tokens"] > 0 and result["perplexity"] > 1


def test_sweep_writes_results_table_and_plots(tiny_folder, profile_file, tmp_path):
    out = tmp_path / "sweep"
    main(["sweep", "--model", str(tiny_folder), "--profile", str(profile_file), "--budgets", "1/2",
          "--methods", "uniform,alloc-moe,top-p", "--eval-tokens", "512", "--calib-tokens", "512",
          "--seq-len", "32", "--output", str(out)])
    results = json.loads((out / "results.json").read_text())
    assert {"model", "full", "rows"} <= set(results)
    assert [r["method"] for r in results["rows"]] == ["uniform", "alloc-moe", "top-p"]
    for row in results["rows"]:
        assert row["budget"] == 0.5 and row["budget_activations"] == 6
        assert row["relative_change"] == pytest.approx(row["perplexity"] / results["full"]["perplexity"] - 1)
    for name in ("results.md", "quality_vs_activations.png", "allocations.png"):
        assert (out / name).stat().st_size > 100
    assert (out / "quality_vs_activations.png").read_bytes()[:4] == b"\x89PNG"


def test_old_flag_spellings_still_work_and_warn_and_prefixes_are_refused(tiny_folder, tmp_path, capsys):
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    common = ["eval", "--model", str(tiny_folder), "--seq-len", "32", "--quiet"]
    main(common + ["--eval-tokens", "256", "--output", str(new)])
    assert "deprecated" not in capsys.readouterr().err
    main(common + ["--max-tokens", "256", "--output-json", str(old)])
    err = capsys.readouterr().err
    assert "allocmoe: warning: --max-tokens is deprecated; use --eval-tokens" in err
    assert "allocmoe: warning: --output-json is deprecated; use --output" in err
    a, b = json.loads(new.read_text()), json.loads(old.read_text())
    assert a["tokens"] == b["tokens"] <= 256 and a["perplexity"] == b["perplexity"]
    for argv in (["eval", "--model", str(tiny_folder), "--out", str(tmp_path / "x.json")],      # not --output
                 ["profile", "--model", str(tiny_folder), "--calib", "64", "--output", str(tmp_path / "p.json")]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "p.json").exists()


def test_quiet_turns_the_progress_bar_off(tiny_folder, tmp_path, capsys):
    for quiet in (False, True):
        main(["profile", "--model", str(tiny_folder), "--calib-tokens", "128", "--seq-len", "32",
              "--output", str(tmp_path / f"p{quiet}.json")] + (["--quiet"] if quiet else []))
        err = capsys.readouterr().err
        assert ("profile:" in err) != quiet, err
    from allocmoe import allocate, load_model

    allocate(0.5, "uniform", model=load_model(tiny_folder)[0]).save(tmp_path / "plan.json")
    for quiet in (False, True):
        main(["analyze", "--model", str(tiny_folder), "--plan", str(tmp_path / "plan.json"), "--eval-tokens", "128",
              "--seq-len", "32", "--output", str(tmp_path / f"a{quiet}")] + (["--quiet"] if quiet else []))
        err = capsys.readouterr().err
        assert ("perplexity:" in err) != quiet, err


@pytest.mark.parametrize("budget,message", [("0", "must be positive"), ("-1", "must be positive"),
                                            ("1.5", "below 3"), ("13", "above the full budget"),
                                            ("lots", "not a number")])
def test_bad_budgets(tiny_folder, profile_file, tmp_path, capsys, budget, message):
    out = tmp_path / "plan.json"
    expect_error(capsys, ["allocate", "--profile", str(profile_file), "--budget", budget, "--method", "alloc-l",
                          "--model", str(tiny_folder), "--output", str(out)], message)
    assert not out.exists()


def test_bad_files(tiny_folder, profile_file, tmp_path, capsys):
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"format_version": 1, "sensit')
    expect_error(capsys, ["allocate", "--model", str(tiny_folder), "--profile", str(corrupt), "--budget", "0.5",
                          "--method", "alloc-l", "--output", str(tmp_path / "p.json")], "corrupt or truncated")
    expect_error(capsys, ["allocate", "--model", str(tiny_folder), "--profile", str(tmp_path / "missing.json"),
                          "--budget", "0.5", "--method", "alloc-l", "--output", str(tmp_path / "p.json")], "not found")
    plan = json.loads(json.dumps({"format_version": 1, "model": {"model_type": "olmoe", "num_moe_layers": 3,
                      "num_experts": 8, "k_orig": 4, "moe_layers": [0, 1, 2]}, "budget": {"activations_per_token": 6, "full": 12, "fraction": 0.5},
                      "method": "x", "layers": {str(i): {"k": 2, "policy": "top-k"} for i in range(3)}}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps(plan))
    expect_error(capsys, ["eval", "--model", str(tiny_folder), "--plan", str(other)], "made for another model")
    plan["layers"]["0"]["policy"] = "sparkle"
    other.write_text(json.dumps(plan))
    expect_error(capsys, ["eval", "--model", str(tiny_folder), "--plan", str(other)], "unknown policy 'sparkle'")
    plan["layers"]["0"] = {"k": 9, "policy": "top-k"}
    other.write_text(json.dumps(plan))
    expect_error(capsys, ["eval", "--model", str(tiny_folder), "--plan", str(other)], "layer 0: k 9 is above k_orig 4")
    plan["layers"]["0"] = {"k": 2, "policy": "alloc-t", "k_base": 3}
    other.write_text(json.dumps(plan))
    expect_error(capsys, ["eval", "--model", str(tiny_folder), "--plan", str(other)], "k_base 3 is above k 2")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    expect_error(capsys, ["eval", "--model", str(tiny_folder), "--text", str(empty)], "is empty")
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    expect_error(capsys, ["eval", "--model", str(tiny_folder), "--text", str(short)], "too short")
    expect_error(capsys, ["eval", "--model", str(tmp_path / "nowhere")], "model folder not found")


def test_unsupported_architecture_is_refused(tmp_path, capsys):
    from transformers import AutoConfig

    AutoConfig.for_model("phimoe", vocab_size=64, hidden_size=16, num_hidden_layers=1,
                         num_attention_heads=2).save_pretrained(tmp_path)
    expect_error(capsys, ["eval", "--model", str(tmp_path)], "unsupported architecture 'phimoe'")


def test_errors_reach_the_shell_as_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "allocmoe", "eval", "--model", str(tmp_path / "none")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("allocmoe: error: model folder not found")
    assert "Traceback" not in proc.stderr


def test_an_unexpected_failure_is_one_line_and_exit_1_and_debug_shows_the_traceback(tmp_path, monkeypatch, capsys):
    from allocmoe.cli import measure

    def broken(args):
        raise RuntimeError("boom\n  a second line a traceback-like message would add")

    monkeypatch.setattr(measure, "cmd_compare", broken)
    argv = ["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 1 and len(err) == 1
    assert err[0].startswith("allocmoe: error: unexpected failure (RuntimeError: boom)") and "--debug" in err[0]
    with pytest.raises(RuntimeError, match="boom"):
        main(argv + ["--debug"])


def test_sigterm_unwinds_like_ctrl_c(tmp_path):
    """`kill` on a running command: exit 130 and the interrupted line, not a silent death. The command
    sleeps 10 minutes, so 130 can only come from the signal; the timeout only guards a hang."""
    import os
    import signal

    script = ("import time, allocmoe.cli as c, allocmoe.cli.measure as m\n"
              "m.cmd_compare = lambda args: (print('ready', flush=True), time.sleep(600))\n"
              "c.main(['compare', 'a', 'b'])\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "allocmoe: interrupted" in err
