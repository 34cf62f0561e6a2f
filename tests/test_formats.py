"""Plan and profile files: typed, validated, fuzzed. Every document is either accepted (and then valid
by every rule the format states, independently re-checked here) or refused with one AllocMoeError;
never another exception, through the Python API and through the CLI."""

from __future__ import annotations

import copy
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocmoe import AllocMoeError, Plan, load_profile
from allocmoe.calibrate.profile import checked_profile
from allocmoe.cli import main

FINGERPRINT = {"model_type": "deepseek_v2", "num_moe_layers": 3, "num_experts": 8, "k_orig": 4, "moe_layers": [1, 2, 3]}


def valid_plan() -> dict:
    return {"format_version": 1, "model": dict(FINGERPRINT),
            "budget": {"activations_per_token": 6.5, "full": 12, "fraction": 6.5 / 12}, "method": "hand",
            "layers": {"1": {"policy": "top-k", "k": 2}, "2": {"policy": "alloc-t", "k": 1.5, "k_base": 1,
                                                               "pool": "batch"},
                       "3": {"policy": "top-p", "p": 0.9, "k": 3.0}},
            "provenance": {"note": "written by hand"}}


def valid_profile() -> dict:
    return {"format_version": 1, "model": dict(FINGERPRINT), "k_orig": 4, "num_layers": 3, "metric": "perplexity",
            "calibration": {"text": "built-in calibration", "sha256": "0123456789abcdef", "tokens_scored": 1000,
                            "windows": 4, "seq_len": 251, "max_tokens": 1004, "batch_size": 4},
            "sensitivity": [[90.0, 80.0, 75.0, 74.0], [88.0, 79.0, 76.0, 75.0], [86.0, 77.0, 75.5, 75.0]],
            "provenance": {}}


# -- independent checks of an accepted document (the rules as docs/formats.md states them) --------------

def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_whole(x) -> bool:
    return is_number(x) and float(x).is_integer()


def independently_valid(check, doc) -> bool:
    try:
        check(doc)
        return True
    except (AssertionError, KeyError, TypeError, ValueError, AttributeError, OverflowError):
        return False


def assert_valid_fingerprint(fp: dict) -> None:
    assert set(fp) == set(FINGERPRINT)
    assert isinstance(fp["model_type"], str) and fp["model_type"]
    for key in ("num_moe_layers", "num_experts", "k_orig"):
        assert is_whole(fp[key]) and 1 <= fp[key] <= 2**53
    assert fp["k_orig"] <= fp["num_experts"] and len(fp["moe_layers"]) == fp["num_moe_layers"]
    assert all(is_whole(i) and 0 <= i <= 2**53 for i in fp["moe_layers"]) and sorted(set(fp["moe_layers"])) == fp["moe_layers"]


def assert_valid_plan_document(doc: dict) -> None:
    assert set(doc) <= {"format_version", "model", "budget", "method", "layers", "provenance"}
    assert isinstance(doc.get("provenance", {}), dict) and isinstance(doc["layers"], dict)
    assert type(doc["format_version"]) is int and doc["format_version"] == 1 and isinstance(doc["method"], str) and doc["method"]
    assert all(isinstance(entry, dict) and entry.get("policy") in ("top-k", "alloc-t", "top-p", "naee", "distinct")
               for entry in doc["layers"].values())
    fp = doc["model"]
    assert_valid_fingerprint(fp)
    assert sorted(doc["layers"], key=int) == [str(i) for i in fp["moe_layers"]]
    for entry in doc["layers"].values():
        fields = {"top-k": {"k"}, "alloc-t": {"k", "k_base", "pool"}, "top-p": {"p", "k"}, "naee": {"beta", "k"},
                  "distinct": {"max_experts", "k_floor", "k"}}
        assert set(entry) - {"policy"} <= fields[entry["policy"]]
        k = entry.get("k")
        if entry["policy"] == "top-k":
            assert is_whole(k) and 1 <= k <= fp["k_orig"]
        elif k is not None:
            assert is_number(k) and 1 <= k <= fp["k_orig"]
        if entry["policy"] == "alloc-t":
            assert is_whole(entry.get("k_base", 1)) and 0 <= entry.get("k_base", 1) <= k
            assert entry.get("pool", "batch") in ("batch", "sequence")
        if entry["policy"] == "top-p":
            assert is_number(entry["p"]) and 0 < entry["p"] <= 1
        if entry["policy"] == "naee":
            assert is_number(entry["beta"]) and entry["beta"] >= 0
        if entry["policy"] == "distinct":
            assert is_whole(entry["max_experts"]) and 1 <= entry["max_experts"] <= 2**53
            assert is_whole(entry.get("k_floor", 1)) and 1 <= entry.get("k_floor", 1) <= fp["k_orig"]
    budget = doc["budget"]
    assert set(budget) == {"activations_per_token", "full", "fraction"}
    spend = budget["activations_per_token"]
    assert is_number(spend) and fp["num_moe_layers"] * (1 - 1e-9) <= spend <= budget["full"] * (1 + 1e-9)
    assert budget["full"] == fp["num_moe_layers"] * fp["k_orig"] and is_number(budget["fraction"]) and budget["fraction"] > 0
    # issue 39: the budget agrees with the layers (fixed spends counted, the rest at their least) and itself
    least = sum(e["k"] if e["policy"] in ("top-k", "alloc-t") else fp["k_orig"] if e["policy"] == "distinct"
                else 1 for e in doc["layers"].values())
    assert least <= spend * (1 + 1e-9) and abs(budget["fraction"] - spend / budget["full"]) <= 1e-6


def assert_valid_profile_document(doc: dict) -> None:
    assert set(doc) <= {"format_version", "model", "k_orig", "num_layers", "metric", "calibration", "sensitivity",
                        "provenance"} and isinstance(doc.get("provenance", {}), dict)
    calibration = doc["calibration"]
    assert set(calibration) == {"text", "sha256", "tokens_scored", "windows", "seq_len", "max_tokens", "batch_size"}
    assert isinstance(calibration["text"], str) and isinstance(calibration["sha256"], str)
    assert all(is_whole(calibration[key]) and 1 <= calibration[key] <= 2**53       # counts are exact in a double
               for key in ("tokens_scored", "windows", "max_tokens", "batch_size"))
    assert is_whole(calibration["seq_len"]) and 2 <= calibration["seq_len"] <= 2**53
    assert_valid_fingerprint(doc["model"])
    assert type(doc["format_version"]) is int and doc["format_version"] == 1 and doc["metric"] == "perplexity"
    assert doc["k_orig"] == doc["model"]["k_orig"] and doc["num_layers"] == doc["model"]["num_moe_layers"]
    assert len(doc["sensitivity"]) == doc["num_layers"]
    assert all(len(row) == doc["k_orig"] and all(is_number(v) and v >= 1 for v in row) for row in doc["sensitivity"])


# -- mutations ------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.sampled_from([0, 1, 2, 3, 4, 5, 8, 12, -1, 10**400])
    | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.5, 1.5, 2.0, 4.0, 4.5, 1e308, -0.0])
    | st.text(max_size=8) | st.sampled_from(["top-k", "alloc-t", "top-p", "naee", "distinct", "batch", "sequence", "1",
                                             "x"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6)


def paths(obj, prefix=()):
    """Every path to a value inside a document, the root's children first."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield prefix + (key,)
            yield from paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield prefix + (i,)
            yield from paths(value, prefix + (i,))


@st.composite
def mutated(draw, base):
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        where = list(paths(doc))
        if not where:
            break
        path = draw(st.sampled_from(where))
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        action = draw(st.sampled_from(["set", "set", "delete", "add"]))
        if action == "set":
            parent[path[-1]] = draw(json_values)
        elif action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=6) | st.sampled_from(["k", "k_base", "p", "4", "0"]))] = \
                draw(json_values)
    return doc


edge_numbers = st.sampled_from([0, 0.5, 1, 1.0, 1.5, 2, 2.5, 3, 4, 4.0, 4.5, 5, 8, 12, 13, -1])


def mostly(valid, edge):
    """Nine draws in ten from `valid`, so whole documents are valid often enough to test acceptance."""
    return st.integers(0, 9).flatmap(lambda roll: edge if roll == 0 else valid)


@st.composite
def plausible_plans(draw):
    """Whole documents near the edges of validity (about half valid), to test acceptance as hard as refusal."""
    k_orig = draw(st.integers(1, 6))
    layers = sorted(set(draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))))
    fp = {"model_type": "deepseek_v2", "num_moe_layers": len(layers), "num_experts": draw(st.integers(k_orig, 8)),
          "k_orig": k_orig, "moe_layers": layers}
    entries = {}
    for index in layers:
        policy = draw(st.sampled_from(["top-k", "alloc-t", "top-p", "naee", "distinct"]))
        entry = {"policy": policy}
        if policy == "top-k":
            entry["k"] = draw(mostly(st.integers(1, k_orig), st.integers(0, k_orig + 1) | edge_numbers))
        elif policy == "alloc-t":
            entry["k"] = draw(mostly(st.floats(1, k_orig), st.floats(0.5, k_orig + 0.5) | edge_numbers))
            entry.update(draw(st.fixed_dictionaries({}, optional={
                "k_base": mostly(st.integers(0, 1), st.integers(-1, 3) | edge_numbers),
                "pool": mostly(st.sampled_from(["batch", "sequence"]), st.just("x"))})))
        elif policy == "top-p":
            entry["p"] = draw(mostly(st.floats(0.01, 1), st.floats(-0.1, 1.1) | edge_numbers))
        elif policy == "distinct":
            entry["max_experts"] = draw(mostly(st.integers(1, 8), st.integers(-1, 9) | edge_numbers))
            entry.update(draw(st.fixed_dictionaries({}, optional={
                "k_floor": mostly(st.integers(1, k_orig), st.integers(0, k_orig + 1) | edge_numbers),
                "k": mostly(st.floats(1, k_orig), edge_numbers)})))
        else:
            entry["beta"] = draw(mostly(st.floats(0, 2), st.floats(-0.1, 2.0) | edge_numbers))
        entries[str(index)] = entry
    full = len(layers) * k_orig
    spend = draw(mostly(st.floats(len(layers), full), st.floats(0.0, full * 1.1) | edge_numbers))
    return {"format_version": 1, "model": fp, "budget": {"activations_per_token": spend, "full": full,
                                                         "fraction": spend / full},
            "method": draw(st.sampled_from(["alloc-moe", "uniform", ""])), "layers": entries}


def load_plan_or_refuse(doc):
    """Plan.from_dict accepts exactly the documents the independent checks call valid."""
    try:
        plan = Plan.from_dict(doc)
    except AllocMoeError as exc:
        assert "\n" not in str(exc) and str(exc)
        assert not independently_valid(assert_valid_plan_document, doc), f"refused a valid plan: {exc}"
        return None
    assert_valid_plan_document(doc)
    assert Plan.from_dict(plan.to_document()).layers == plan.layers       # what it writes, it reads back
    return plan


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(valid_plan()))
def test_fuzzed_plans_are_accepted_valid_or_refused_with_allocmoe_error(doc):
    load_plan_or_refuse(doc)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(valid_profile()))
def test_fuzzed_profiles_are_accepted_valid_or_refused_with_allocmoe_error(doc):
    try:
        profile = checked_profile(doc)
    except AllocMoeError as exc:
        assert "\n" not in str(exc) and str(exc)
        assert not independently_valid(assert_valid_profile_document, doc), f"refused a valid profile: {exc}"
        return
    assert_valid_profile_document(doc)
    # sensitivities are perplexities, read as floats: a whole number above 2**53 comes back rounded
    assert profile["sensitivity"] == [[float(x) for x in row] for row in doc["sensitivity"]]


@settings(max_examples=300, deadline=None)
@given(plausible_plans())
def test_plausible_plans_are_accepted_exactly_when_valid(doc):
    load_plan_or_refuse(doc)


def test_the_unmutated_documents_load():
    assert load_plan_or_refuse(valid_plan()) is not None
    assert checked_profile(valid_profile())["k_orig"] == 4


@pytest.mark.parametrize("change,message", [
    (lambda d: d["layers"]["1"].update(k=2.5), "layers.1.k: must be a whole number, got 2.5"),
    (lambda d: d["layers"]["1"].update(k=5), "layer 1: k 5 is above k_orig 4"),
    (lambda d: d["layers"]["1"].update(k="2"), "layers.1.k: must be a number, got '2'"),
    (lambda d: d["layers"]["2"].update(k=float("nan")), "layers.2.k: Input should be a finite number"),
    (lambda d: d["layers"]["2"].update(colour="red"), "layers.2.colour: unknown field"),
    (lambda d: d.pop("budget"), "budget: missing field"),
    (lambda d: d["layers"].pop("3"), "layers must be exactly the MoE layers ['1', '2', '3']"),
    (lambda d: d.update(format_version=0), "format_version 0 but this allocmoe reads version 1"),
    (lambda d: d.update(format_version=True), "format_version True but this allocmoe reads version 1"),
    (lambda d: d.update(format_version=1.0), "format_version 1.0 but this allocmoe reads version 1"),
    (lambda d: d["model"].update(k_orig=16), "k_orig 16 is above num_experts 8"),
])
def test_plan_refusals_name_the_field_and_the_fix(change, message):
    doc = valid_plan()
    change(doc)
    with pytest.raises(AllocMoeError) as exc:
        Plan.from_dict(doc, source="plan p.json")
    assert message in str(exc.value) and "allocmoe allocate" in str(exc.value), str(exc.value)


@pytest.mark.parametrize("change,message", [
    (lambda d: d["sensitivity"][1].pop(), "sensitivity row 1 has 3 values for k = 1..4"),
    (lambda d: d["sensitivity"].pop(), "sensitivity has 2 rows for 3 layers"),
    (lambda d: d["sensitivity"][0].__setitem__(2, None), "sensitivity.0.2: must be a number, got None"),
    (lambda d: d["sensitivity"][0].__setitem__(2, -3.0), "sensitivity.0.2: Input should be greater than or equal to 1"),
    (lambda d: d["sensitivity"][0].__setitem__(2, float("inf")), "sensitivity.0.2: Input should be a finite number"),
    (lambda d: d.update(extra={}), "extra: unknown field"),
    (lambda d: d["calibration"].pop("sha256"), "calibration.sha256: missing field"),
])
def test_profile_refusals_name_the_field_and_the_fix(change, message):
    doc = valid_profile()
    change(doc)
    with pytest.raises(AllocMoeError) as exc:
        checked_profile(doc, "profile p.json")
    assert message in str(exc.value) and "allocmoe profile" in str(exc.value), str(exc.value)


def test_nan_is_never_written_to_json(tmp_path, capsys):
    from allocmoe.core.files import atomic_write_json

    atomic_write_json(tmp_path / "r.json", {"ppl": float("inf"), "rows": [1.0, float("nan")]})
    text = (tmp_path / "r.json").read_text()
    assert json.loads(text) == {"ppl": None, "rows": [1.0, None]} and "NaN" not in text and "Infinity" not in text
    assert "ppl, rows[1] not finite (NaN or infinity), written as null" in capsys.readouterr().err


def test_published_schemas_are_current():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("write_schemas", root / "scripts" / "write_schemas.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, text in module.render().items():
        assert (root / "docs" / "schemas" / name).read_text() == text, "run python scripts/write_schemas.py"


def test_the_schemas_agree_with_the_validators_on_examples():
    """jsonschema-rs (installed with schemathesis) against the published schema: the valid documents pass,
    and documents the schema alone can judge (types, unknown fields, bounds) are refused by both."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    from allocmoe.core.formats import json_schemas

    plan_schema, profile_schema = (jsonschema_rs.validator_for(s) for s in json_schemas().values())
    assert plan_schema.is_valid(valid_plan()) and profile_schema.is_valid(valid_profile())
    bad = valid_plan()
    bad["layers"]["1"]["k"] = "2"
    assert not plan_schema.is_valid(bad)
    bad = valid_profile()
    bad["sensitivity"][0][0] = 0.5
    assert not profile_schema.is_valid(bad)


# -- through the CLI: files on disk, one line and exit 2 or success ----------------------------------

def run_cli(argv, capsys):
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(doc=mutated(valid_plan()))
def test_fuzzed_plan_files_through_the_cli(doc, tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))                     # Python writes NaN/Infinity tokens: they must be refused
    code, err = run_cli(["export", "--format", "vllm", "--plan", str(path)], capsys)
    accepted = load_plan_or_refuse(doc) is not None
    assert code == 2 if not accepted else code in (0, 2), err      # a valid plan may still not suit an engine
    if code == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("allocmoe: error: ") and "Traceback" not in err, err


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(doc=mutated(valid_profile()))
def test_fuzzed_profile_files_through_the_cli(doc, tmp_path, capsys):
    path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    out.unlink(missing_ok=True)
    code, err = run_cli(["allocate", "--profile", str(path), "--method", "alloc-l", "--budget", "0.5",
                         "--output", str(out), "--quiet"], capsys)
    try:
        load_profile(path)
        accepted = True
    except AllocMoeError:
        accepted = False
    if code == 2:
        lines = [line for line in err.splitlines() if line.strip() and "warning" not in line]
        assert len(lines) == 1 and lines[0].startswith("allocmoe: error: ") and "Traceback" not in err, err
        assert not out.exists()
    else:
        assert code == 0 and accepted and out.exists(), err
        assert_valid_plan_document(json.loads(out.read_text()))


# -- issue 39: JSON as the standard reads it, never a raw exception --------------------------------------

def _plan_text(**replace) -> str:
    text = json.dumps(valid_plan())
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new, 1)
    return text


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("text,message", [
    (DEEP, "nested more than 64 levels deep"),
    ('{"a":' * 100_000 + "1" + "}" * 100_000, "nested more than 64 levels deep"),
    (_plan_text(**{'"provenance": {': '"provenance": {"x": ' + "[" * 65 + "]" * 65 + ", "}),
     "nested more than 64 levels deep"),
    (_plan_text(**{'"method": "hand"': '"method": "hand", "method": "alloc-moe"'}),
     "the key 'method' appears twice in one object"),
    (_plan_text(**{'"k": 2}': '"k": 2, "k": 4}'}), "the key 'k' appears twice"),
    (_plan_text(**{'"p": 0.9': '"p": NaN'}), "NaN is not a JSON number"),
    (_plan_text(**{'"provenance": {': '"provenance": {"x": -Infinity, '}), "-Infinity is not a JSON number"),
    (_plan_text(**{'"provenance": {': '"provenance": {"x": 1e400, '}), "the number 1e400 is too large"),
    (_plan_text(**{'"provenance": {': '"provenance": {"x": ' + "9" * 5000 + ", "}), "too many for a double"),
    (_plan_text(**{'"provenance": {': '"provenance": {"\\ud800": 1, '}), "lone surrogate"),
    (_plan_text(**{'"note": "written by hand"': '"note": "\\udfff"'}), "lone surrogate"),
], ids=["brackets", "objects", "provenance", "duplicate-method", "duplicate-k", "nan", "infinity", "1e400",
        "5000-digits", "surrogate-key", "surrogate-value"])
def test_json_the_standard_refuses_is_one_clear_error(text, message, tmp_path, capsys):
    """100,000 nested brackets were a RecursionError (exit 1 from the CLI), a duplicate key silently
    kept its last value, and NaN/Infinity/1e400 read as Python floats: each is now one AllocMoeError,
    from Plan.load, load_profile and the CLI alike."""
    path = tmp_path / "doc.json"
    path.write_text(text)
    with pytest.raises(AllocMoeError, match=message) as exc:
        Plan.load(path)
    assert "\n" not in str(exc.value) and "recreate it" in str(exc.value)
    with pytest.raises(AllocMoeError, match=message):
        load_profile(path)
    for argv in (["export", "--format", "vllm", "--plan", str(path)],
                 ["allocate", "--profile", str(path), "--method", "alloc-l", "--budget", "0.5", "--output",
                  str(tmp_path / "out.json")]):
        code, err = run_cli(argv, capsys)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.json"]


def test_a_profile_with_a_duplicate_key_is_refused(tmp_path):
    text = json.dumps(valid_profile()).replace('"metric": "perplexity"', '"metric": "perplexity", "metric": "x"')
    (tmp_path / "p.json").write_text(text)
    with pytest.raises(AllocMoeError, match="the key 'metric' appears twice"):
        load_profile(tmp_path / "p.json")


def test_documents_built_in_python_are_held_to_the_same_depth():
    """Plan.from_dict and checked_profile take dicts from Python too: a deep provenance there would
    exhaust the recursion of whatever walks it later (saving it, printing it)."""
    deep = []
    for _ in range(100_000):
        deep = [deep]
    for build, doc in ((Plan.from_dict, valid_plan()), (checked_profile, valid_profile())):
        doc["provenance"] = {"deep": deep}
        with pytest.raises(AllocMoeError, match="nested more than 64 levels deep"):
            build(doc)
        doc["provenance"] = {"ok": [[[[1]]]]}
        build(doc)


# -- issue 39: a plan's declared budget agrees with its layers ------------------------------------------

def _with(layers: dict, spend: float, fraction: float | None = None) -> dict:
    doc = valid_plan()
    doc["layers"] = layers
    doc["budget"] = {"activations_per_token": spend, "full": 12, "fraction": spend / 12 if fraction is None else fraction}
    return doc


FULL_K = {str(i): {"policy": "top-k", "k": 4} for i in (1, 2, 3)}


@pytest.mark.parametrize("doc,message", [
    (_with(FULL_K, 6.0), "the layers spend at least 12 activations per token but budget.activations_per_token says 6"),
    (_with({str(i): {"policy": "alloc-t", "k": 2.5} for i in (1, 2, 3)}, 7.0), "spend at least 7.5"),
    (_with({"1": {"policy": "top-k", "k": 4}, "2": {"policy": "top-k", "k": 4}, "3": {"policy": "top-p", "p": 1.0}},
           8.5), "spend at least 9"),
    (_with({str(i): {"policy": "distinct", "max_experts": 8, "k_floor": 1} for i in (1, 2, 3)}, 6.0),
     "spend at least 12"),
    (_with({"1": {"policy": "distinct", "max_experts": 2}, "2": {"policy": "top-k", "k": 1},
            "3": {"policy": "naee", "beta": 0.5}}, 5.0), "spend at least 6"),
    (_with({str(i): {"policy": "top-k", "k": 2} for i in (1, 2, 3)}, 6.0, fraction=0.9),
     "budget.fraction 0.9 is not activations_per_token / full = 0.5"),
])
def test_a_plan_whose_budget_disagrees_with_its_layers_is_refused(doc, message, tmp_path, capsys):
    """A plan saying 0.5 while every layer runs at full K was accepted and ran at full cost (and export's
    engine-wide k, which reads the budget, would have been wrong): the fixed spends of its layers (top-k,
    alloc-t k; a distinct layer K_orig; one expert for top-p and naee) must fit the declared budget."""
    with pytest.raises(AllocMoeError, match=message.replace("(", r"\(")):
        Plan.from_dict(doc)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    code, err = run_cli(["export", "--format", "vllm-global", "--plan", str(path)], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("doc", [
    _with({str(i): {"policy": "top-k", "k": 2} for i in (1, 2, 3)}, 6.0),
    _with({str(i): {"policy": "top-k", "k": 1} for i in (1, 2, 3)}, 6.5),         # spends less than allowed
    _with({str(i): {"policy": "alloc-t", "k": 2.0 + 1 / 3} for i in (1, 2, 3)}, 7.0),   # rounding of B / L
    _with({str(i): {"policy": "top-p", "p": 0.5, "k": 4.0} for i in (1, 2, 3)}, 3.0),   # measured k: informational
    _with({str(i): {"policy": "distinct", "max_experts": 2} for i in (1, 2, 3)}, 12.0),
    _with(FULL_K, 12.0, fraction=1.0000004),                                        # written rounded to 6 places
])
def test_plans_whose_budget_covers_their_layers_load(doc):
    Plan.from_dict(doc)
