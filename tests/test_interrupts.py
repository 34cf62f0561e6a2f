"""Killing `profile` and `sweep` mid-run, as real processes, with SIGTERM (`kill`) and SIGINT (what
Ctrl-C sends): exit 130 with one line and no traceback, nothing stray or half-written, and a rerun
that resumes.

What a killed run leaves, checked here:
  * `profile --output P.json`: only `P.json.partial.json` (the finished cells); a rerun with the same
    arguments starts its bar at those cells and ends with the profile an uninterrupted run makes.
  * `sweep --output DIR`, killed while profiling: only `DIR/profile.json.partial.json`, resumed the
    same way by a rerun; killed after profiling and some rows: the finished `DIR/profile.json`, which
    a rerun reuses without profiling again, and `DIR/rows.partial.json`, whose rows it does not score
    again (its bar starts at them).
  * the interrupted line names what a rerun picks up: "N of 10 cells kept in P" or "profile done, N
    of 6 rows kept in P". The result files (results.json, plans.json, results.md, two PNGs)
    appear together at the end or not at all, and no temporary file or folder is left anywhere.

Each command runs three times on one output: killed by SIGTERM, rerun and killed by SIGINT further
on, rerun to the end; the profile and sweep runs go side by side to keep the test short.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from allocmoe.calibrate.profile import profile_sensitivity
from allocmoe.models import load_model
from allocmoe.texts import read_text

WAIT_S = 120                 # bound on every wait; a run here takes seconds
CALIB = {"seq_len": 256, "calib_tokens": 2048, "windows_per_pass": 4}      # 10 cells of a tenth of a second or so
CELLS = 3 * 4 - 2            # the tiny model: 3 MoE layers, K = 4
RESULTS = {"results.json", "plans.json", "results.md", "quality_vs_activations.png", "allocations.png"}
RESUME = "allocmoe: interrupted; rerun the same command to resume: "
INTERRUPTED = {      # what each killed run says it kept: (command, step) -> the line's pattern
    ("profile", 0): RESUME + r"\d+ of 10 cells kept in \S+/profile/p\.json\.partial\.json",
    ("profile", 1): RESUME + r"\d+ of 10 cells kept in \S+/profile/p\.json\.partial\.json",
    ("sweep", 0): RESUME + r"\d+ of 10 cells kept in \S+/sweep/sweep/profile\.json\.partial\.json",
    ("sweep", 1): RESUME + r"profile done, [2-6] of 6 rows kept in \S+/sweep/sweep/rows\.partial\.json"}
BAR = r"[\w .-]+:\s+\d+%\|[^|\r\n]*\|[^\]\r\n]*\]"                 # one tqdm frame


def _argv(command, model, out):
    common = ["--model", str(model), "--calib-tokens", str(CALIB["calib_tokens"]), "--seq-len", str(CALIB["seq_len"])]
    if command == "profile":
        return ["profile", *common, "--output", str(out / "p.json")]
    return ["sweep", *common, "--budgets", "1/2,2/3", "--methods", "uniform,alloc-moe,top-p", "--eval-tokens", "1024",
            "--output", str(out / "sweep")]


def _cells(partial):
    """Finished cells in a profile's partial file (None if there is none)."""
    try:
        return len(json.loads(partial.read_text())["cells"])
    except FileNotFoundError:
        return None


PARTIAL = {"profile": "p.json.partial.json", "sweep": "sweep/profile.json.partial.json"}


def _rows(kept):
    """Finished rows in a sweep's rows.partial.json, the full model's score not counted (None if none)."""
    try:
        return len([name for name in json.loads(kept.read_text())["rows"] if name != "full"])
    except FileNotFoundError:
        return None


def _mid_run(command, step, root, cells_before):
    """When to send the signal: run 1 as soon as a cell is saved; run 2 (resumed) once it has saved one
    more cell (profile) or finished profiling and kept two rows (sweep)."""
    if step == 0:
        return (root / PARTIAL[command]).exists()
    if command == "profile":
        return (_cells(root / PARTIAL[command]) or 0) > cells_before
    return (_rows(root / "sweep" / "rows.partial.json") or 0) >= 2


# step -> (signal, --quiet); the last run is not killed
STEPS = [(signal.SIGTERM, True), (signal.SIGINT, False), (None, False)]


def _sigint_as_usual() -> None:
    """In the child before exec: SIGINT at its default, so Python turns it into KeyboardInterrupt even
    when the suite itself was started with SIGINT ignored (a background job, nohup)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Run:
    """`python -m allocmoe ARGV` in its own session, stdout and stderr to files (a pipe could fill and stall it)."""

    def __init__(self, argv, logs, name):
        self.out, self.err = logs / f"{name}.out", logs / f"{name}.err"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}   # 1 thread, as in-process
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "allocmoe", *argv], stdout=out, stderr=err,
                                         env=env, start_new_session=True, preexec_fn=_sigint_as_usual)

    def finish(self, deadline):
        try:
            self.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        finally:
            self.kill()
        return {"rc": self.proc.returncode, "out": self.out.read_text(), "err": self.err.read_text()}

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _files(root):
    """Every file and folder under `root`, hidden ones too, as relative paths."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _messages(err):
    """stderr as a reader sees it, progress-bar frames taken out: the lines left."""
    return [line.strip() for line in re.split(r"[\r\n]", re.sub(BAR, "", err)) if line.strip()]


def _first_profile_bar(err):
    found = re.search(r"profile:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)", err)
    return (int(found.group(1)), int(found.group(2))) if found else None


@pytest.fixture(scope="module")
def runs(tiny_folder, tmp_path_factory):
    """{command: [run 1, run 2, run 3]}, each with rc, out, err, the files it left, the finished cells
    it found and left, and the profile it wrote; and an uninterrupted profile made in this process."""
    root = tmp_path_factory.mktemp("interrupts")
    logs = root / "logs"
    logs.mkdir()
    record = {command: [] for command in PARTIAL}
    live = []
    reference = None
    try:
        for step, (sig, quiet) in enumerate(STEPS):
            started = {}
            for command in record:
                out = root / command
                out.mkdir(exist_ok=True)
                cells = _cells(out / PARTIAL[command])
                run = Run(_argv(command, tiny_folder, out) + (["--quiet"] if quiet else []), logs, f"{command}{step}")
                live.append(run)
                started[command] = (run, cells)
            deadline = time.monotonic() + WAIT_S
            pending = dict(started) if sig else {}
            while pending and time.monotonic() < deadline:         # signal each as soon as it is mid-run
                for command, (run, cells) in list(pending.items()):
                    if _mid_run(command, step, root / command, cells or 0) or run.proc.poll() is not None:
                        run.proc.send_signal(sig)
                        del pending[command]
                time.sleep(0.01)
            assert not pending, f"never got mid-run: {sorted(pending)}"
            if step == len(STEPS) - 1:                             # the uninterrupted profile, meanwhile
                model, tok = load_model(tiny_folder)
                text, name = read_text(None, "calibration")
                reference = profile_sensitivity(model, tok, text, {**CALIB, "progress": False}, calib_name=name)
            for command, (run, cells) in started.items():
                result = run.finish(deadline)
                made = root / command / ("p.json" if command == "profile" else "sweep/profile.json")
                results = root / command / "sweep" / "results.json"
                result.update(results=json.loads(results.read_text()) if results.exists() else None,
                              cells_found=cells, cells_left=_cells(root / command / PARTIAL[command]),
                              rows_left=_rows(root / command / "sweep" / "rows.partial.json"),
                              left=_files(root / command),
                              profile=made.read_bytes() if made.exists() else None)
                record[command].append(result)
    finally:
        for run in live:
            run.kill()
    return record, reference


KILLED = [(command, step) for command in PARTIAL for step in (0, 1)]


@pytest.mark.parametrize("command,step", KILLED)
def test_a_killed_run_exits_130_with_one_line_and_no_traceback(runs, command, step):
    killed = runs[0][command][step]
    assert killed["rc"] == 130, killed["err"]
    assert "Traceback" not in killed["err"] and killed["out"] == ""
    assert len(_messages(killed["err"])) == 1, killed["err"]
    assert re.fullmatch(INTERRUPTED[command, step], _messages(killed["err"])[0]), killed["err"]


@pytest.mark.parametrize("command,step", KILLED)
def test_the_interrupted_message_is_the_last_line_and_a_line_of_its_own(runs, command, step):
    # every bar is closed as the interrupt unwinds: not drawn again after the message, nor glued to it
    killed = runs[0][command][step]
    assert re.fullmatch(INTERRUPTED[command, step], re.split(r"[\r\n]", killed["err"].rstrip("\r\n"))[-1]), killed["err"]


def test_a_killed_profile_leaves_only_its_partial_and_resumes_to_the_uninterrupted_profile(runs):
    record, reference = runs
    first, second, last = record["profile"]
    for killed in (first, second):
        assert killed["left"] == ["p.json.partial.json"]           # no p.json, no .tmp
    assert 1 <= first["cells_left"] < second["cells_left"] < CELLS
    assert _first_profile_bar(second["err"]) == (first["cells_left"], CELLS)    # finished cells skipped
    assert _first_profile_bar(last["err"]) == (second["cells_left"], CELLS)
    assert last["rc"] == 0, last["err"]
    assert last["left"] == ["p.json"]                                # the partial is gone
    assert json.loads(last["profile"])["sensitivity"] == reference["sensitivity"]


def _first_sweep_bar(err):
    found = re.search(r"sweep:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)", err)
    return (int(found.group(1)), int(found.group(2))) if found else None


def test_a_killed_sweep_leaves_its_profile_and_rows_and_resumes_without_doing_them_again(runs):
    record, reference = runs
    first, second, last = record["sweep"]
    assert first["left"] == ["sweep", "sweep/profile.json.partial.json"]      # killed while profiling
    assert _first_profile_bar(second["err"]) == (first["cells_left"], CELLS)
    # killed after two rows or more: the profile and the rows, no results, no temp
    assert second["left"] == ["sweep", "sweep/profile.json", "sweep/rows.partial.json"]
    assert f"profile done, {second['rows_left']} of 6 rows kept in" in second["err"]
    assert last["rc"] == 0, last["err"]
    assert _first_profile_bar(last["err"]) is None and "reusing" in last["err"]   # the finished profile
    assert _first_sweep_bar(last["err"]) == (second["rows_left"], 6)            # and the finished rows
    assert last["profile"] == second["profile"]
    assert last["left"] == ["sweep"] + sorted(f"sweep/{name}" for name in RESULTS | {"profile.json"})
    assert json.loads(last["profile"])["sensitivity"] == reference["sensitivity"]
    assert [(row["method"], row["budget_activations"]) for row in last["results"]["rows"]] == [
        (method, budget) for budget in (6, 8) for method in ("uniform", "alloc-moe", "top-p")]


# -- in this process: the result files are swapped in whole, signals wait for it --------------------------
@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return load_model(tiny_folder)


def _sweep(tiny, out, budget):
    from allocmoe.pipelines.sweep import sweep

    model, tok = tiny
    text = " ".join(f"word{i % 37} and thing{i % 11}." for i in range(200))
    return sweep(model, tok, text, text, {"budgets": (budget,), "methods": ("uniform",), "eval_tokens": 128,
                                          "seq_len": 32, "progress": False}, output_dir=out)


def _interrupt_the_second_plot(monkeypatch):
    from allocmoe.measure import report

    save, calls = report.save_png, []

    def interrupted(fig, path):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        save(fig, path)
    monkeypatch.setattr(report, "save_png", interrupted)
    return calls


def test_a_sweep_interrupted_while_writing_leaves_the_earlier_results_whole_and_no_temporary_folder(
        tiny, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    _sweep(tiny, out, "1/2")
    before = {name: (out / name).read_bytes() for name in RESULTS}
    assert set(before) == RESULTS
    calls = _interrupt_the_second_plot(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        _sweep(tiny, out, "1/3")
    assert len(calls) == 2                                      # results.json, plans.json, results.md were written
    # the finished rows are kept for a rerun; the result files are the earlier ones, whole
    assert _files(tmp_path) == ["sweep"] + sorted(f"sweep/{name}" for name in RESULTS | {"rows.partial.json"})
    assert {name: (out / name).read_bytes() for name in RESULTS} == before


def test_a_new_output_folder_gets_its_results_whole_or_not_at_all(tiny, tmp_path, monkeypatch):
    out = tmp_path / "deeper" / "sweep"
    with monkeypatch.context() as patch:
        _interrupt_the_second_plot(patch)
        with pytest.raises(KeyboardInterrupt):
            _sweep(tiny, out, "1/2")
    assert _files(tmp_path) == ["deeper", "deeper/sweep", "deeper/sweep/rows.partial.json"]   # the rows, no result
    _sweep(tiny, out, "1/2")
    assert _files(out) == sorted(RESULTS)
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask          # a usual folder, not mkdtemp's 0700


def test_an_analysis_interrupted_while_writing_leaves_nothing(tiny, tmp_path, monkeypatch):
    from allocmoe.calibrate.methods import allocate
    from allocmoe.measure.analyze import analyze_plan, write_analysis
    from allocmoe.scoring import tokenize_windows

    model, tok = tiny
    text = " ".join(f"word{i % 37} and thing{i % 11}." for i in range(200))
    result = analyze_plan(model, tok, allocate("0.5", "uniform", model=model), tokenize_windows(tok, text, 32, 128),
                          progress=False)
    calls = _interrupt_the_second_plot(monkeypatch)
    calls.append("pretend one plot was saved")                  # the next (analysis.png) is interrupted
    with pytest.raises(KeyboardInterrupt):
        write_analysis(dict(result), tmp_path / "analysis")
    assert _files(tmp_path) == []                               # analysis.json was not left alone
    monkeypatch.undo()
    write_analysis(result, tmp_path / "analysis")
    assert _files(tmp_path) == ["analysis", "analysis/analysis.json", "analysis/analysis.png"]


def test_sigint_and_sigterm_wait_until_the_held_block_ends():
    from allocmoe.measure.report import signals_held

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)   # as usual, even if the suite ignores it
    try:
        with signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert seen == []
        assert seen == [signal.SIGTERM]
        finished = False
        with pytest.raises(KeyboardInterrupt):
            with signals_held():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                finished = True
        assert finished
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def test_a_bar_caught_while_being_made_is_closed_before_the_interrupted_line(tiny_folder, tmp_path, monkeypatch, capsys):
    """The interrupt can land inside tqdm's constructor, after its first frame and before its `with`
    block is entered, so nothing closes that bar as the stack unwinds (seen once in the sweep run
    above). The CLI closes every open bar before it prints: the message is a line of its own."""
    from tqdm import tqdm

    from allocmoe.calibrate import profile
    from allocmoe.cli import main

    def interrupted(*args, **kwargs):
        bar = tqdm(total=6, desc="sweep", unit="run", file=sys.stderr)   # drawn, never closed; the traceback
        raise KeyboardInterrupt(bar)                                     # keeps it alive, as the real frame did

    monkeypatch.setattr(profile, "profile_sensitivity", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "--model", str(tiny_folder), "--calib-tokens", "128", "--seq-len", "32",
              "--output", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 130
    assert re.split(r"[\r\n]", err.rstrip("\r\n"))[-1] == \
        "allocmoe: interrupted", err
    assert "sweep:" in err and not (tmp_path / "p.json").exists()


# -- a sweep keeps its rows as they finish: a rerun scores only the rest ----------------------------------
SWEEP_ROWS = {"budgets": ("1/2", "2/3"), "methods": ("uniform", "alloc-moe", "top-p"), "eval_tokens": 128,
              "seq_len": 32, "progress": False, "profile": {"calib_tokens": 256}}
TEXT = " ".join(f"word{i % 37} and thing{i % 11}." for i in range(300))


def _counting(monkeypatch):
    """Every full-model evaluation and row the sweep scores, by name, as they start."""
    from allocmoe.pipelines import sweep as sweep_module

    scored = []
    row, full = sweep_module._RowWork.row, sweep_module._RowWork.full

    def counted_row(self, model, tok, budget, method):
        scored.append(f"{method}@{budget.activations_per_token:g}")
        return row(self, model, tok, budget, method)

    def counted_full(self, model, tok):
        scored.append("full")
        return full(self, model, tok)
    monkeypatch.setattr(sweep_module._RowWork, "row", counted_row)
    monkeypatch.setattr(sweep_module._RowWork, "full", counted_full)
    return scored


def _stop_after(rows):
    def on_row(method, fraction):
        on_row.seen += 1
        if on_row.seen == rows:
            raise KeyboardInterrupt
    on_row.seen = 0
    return on_row


def _comparable(results):
    return {key: results[key] for key in ("model", "full", "evaluation", "calibration", "rows")}


def _plans(folder):
    plans = json.loads((folder / "plans.json").read_text())
    for plan in plans.values():
        plan["provenance"].pop("created", None)
    return plans


@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory):
    from allocmoe.pipelines.sweep import sweep

    model, tok = tiny
    out = tmp_path_factory.mktemp("uninterrupted") / "sweep"
    return sweep(model, tok, TEXT, TEXT, SWEEP_ROWS, output_dir=out), out


def test_a_sweep_interrupted_after_two_rows_keeps_them_and_a_rerun_scores_only_the_rest(
        tiny, tmp_path, monkeypatch, uninterrupted):
    from allocmoe.errors import Interrupted
    from allocmoe.pipelines.sweep import sweep

    model, tok = tiny
    out = tmp_path / "sweep"
    scored = _counting(monkeypatch)
    with pytest.raises(Interrupted) as stopped:
        sweep(model, tok, TEXT, TEXT, SWEEP_ROWS, output_dir=out, on_row=_stop_after(2))
    assert stopped.value.resume == f"profile done, 2 of 6 rows kept in {out / 'rows.partial.json'}"
    assert scored == ["full", "uniform@6", "alloc-moe@6"]
    assert _files(tmp_path) == ["sweep", "sweep/profile.json", "sweep/rows.partial.json"]
    scored.clear()
    results = sweep(model, tok, TEXT, TEXT, SWEEP_ROWS, output_dir=out)
    assert scored == ["top-p@6", "uniform@8", "alloc-moe@8", "top-p@8"]         # the kept rows are not scored again
    reference, reference_out = uninterrupted
    assert _comparable(results) == _comparable(reference)
    assert _plans(out) == _plans(reference_out)
    assert _files(tmp_path) == ["sweep"] + sorted(f"sweep/{name}" for name in RESULTS | {"profile.json"})


def test_kept_rows_of_other_settings_are_not_resumed_and_a_warning_says_why(tiny, tmp_path, monkeypatch, capsys):
    from allocmoe.pipelines.sweep import sweep

    model, tok = tiny
    out = tmp_path / "sweep"
    with pytest.raises(KeyboardInterrupt):
        sweep(model, tok, TEXT, TEXT, SWEEP_ROWS, output_dir=out, on_row=_stop_after(2))
    capsys.readouterr()
    scored = _counting(monkeypatch)
    sweep(model, tok, TEXT, TEXT, {**SWEEP_ROWS, "eval_tokens": 96, "methods": ("uniform",)}, output_dir=out)
    assert scored == ["full", "uniform@6", "uniform@8"]                     # other evaluation tokens: all again
    err = capsys.readouterr().err
    assert f"allocmoe: warning: {out / 'rows.partial.json'} was not resumed: its rows were made with other " \
           "settings (evaluation); scoring every row again" in err, err


def test_a_subset_of_the_methods_reuses_the_rows_it_shares(tiny, tmp_path, monkeypatch):
    from allocmoe.pipelines.sweep import sweep

    model, tok = tiny
    out = tmp_path / "sweep"
    with pytest.raises(KeyboardInterrupt):
        sweep(model, tok, TEXT, TEXT, SWEEP_ROWS, output_dir=out, on_row=_stop_after(2))
    scored = _counting(monkeypatch)
    sweep(model, tok, TEXT, TEXT, {**SWEEP_ROWS, "methods": ("uniform", "top-p")}, output_dir=out)
    assert scored == ["top-p@6", "uniform@8", "top-p@8"]


def test_a_ray_sweep_resumes_the_rows_a_single_process_sweep_kept(tiny_folder, tmp_path):
    """The kept rows are keyed the same way on Ray (the folder's weights, the same evaluation tokens):
    a Ray rerun scores only the rows the interrupted run did not keep, to the same table."""
    ray = pytest.importorskip("ray")
    from allocmoe.pipelines.sweep import sweep

    config = {**SWEEP_ROWS, "methods": ("uniform", "top-p")}
    out = tmp_path / "sweep"
    with pytest.raises(KeyboardInterrupt):
        sweep(str(tiny_folder), None, TEXT, TEXT, config, output_dir=out, on_row=_stop_after(1))
    reported = []
    on_ray = sweep(str(tiny_folder), None, TEXT, TEXT, {**config, "ray": "local", "ray_workers": 1},
                   output_dir=out, on_row=lambda method, fraction: reported.append((method, fraction)))
    assert not ray.is_initialized()
    assert sorted(reported) == sorted([("top-p", 0.5), ("uniform", 2 / 3), ("top-p", 2 / 3)])   # not uniform@1/2
    single = sweep(str(tiny_folder), None, TEXT, TEXT, config)
    assert on_ray["rows"] == single["rows"] and on_ray["full"] == single["full"]


def test_an_interrupted_distinct_profile_names_the_cells_it_kept(tiny, tmp_path, monkeypatch):
    from allocmoe.calibrate import distinct as distinct_module
    from allocmoe.errors import Interrupted

    model, tok = tiny
    text = read_text(None, "calibration")[0]
    resume = tmp_path / "plan.json.distinct.partial.json"
    real, calls = distinct_module._score, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 4:                    # the unrestricted pass, then 2 cells, then Ctrl-C
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(distinct_module, "_score", interrupted)
    with pytest.raises(Interrupted) as stopped:
        distinct_module.distinct_profile(model, tok, text, {"decode_batch": 4, "seq_len": 32, "calib_tokens": 512,
                                                            "progress": False}, resume_file=resume)
    cells = len(json.loads(resume.read_text())["cells"])
    assert cells == 2
    assert re.fullmatch(rf"2 of \d+ distinct-profile cells kept in {re.escape(str(resume))}", stopped.value.resume)
