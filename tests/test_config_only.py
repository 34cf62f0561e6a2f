"""Plans without weights (issue 35, item 5): the methods that read only the model's config (uniform,
ascending, descending, alloc-t; alloc-moe and alloc-l given a profile) plan from a folder of
config.json alone, to the byte the plan the same model's folder with weights gives, and the plan is
accepted by the real model (Plan.load, the vLLM plugin's check). A run that needs the weights is
refused on such a folder in one line that names the fix, before anything is read or written."""

from __future__ import annotations

import json
import shutil

import pytest

from allocmoe.cli import main

CONFIG_METHODS = ("uniform", "ascending", "descending", "alloc-t")
# (family, overrides): every router style, and the families whose config makes some layers dense
FAMILIES = [
    ("qwen3_moe", {}),
    ("olmoe", {}),
    ("mixtral", {}),
    ("qwen2_moe", {"num_hidden_layers": 4, "mlp_only_layers": [0, 2]}),
    ("deepseek_v2", {"num_hidden_layers": 4, "first_k_dense_replace": 2}),
    ("deepseek_v3", {"num_hidden_layers": 4, "first_k_dense_replace": 1}),
    ("gpt_oss", {}),
    ("granitemoe", {}),
]
DENSE = {"qwen2_moe": [1, 3], "deepseek_v2": [2, 3], "deepseek_v3": [1, 2, 3]}   # MoE layers the config names


def folders(tmp_path, model_type: str, overrides: dict):
    """(folder with weights, folder with its config.json alone)."""
    from conftest import build_tiny

    full, bare = tmp_path / "full", tmp_path / "bare"
    build_tiny(model_type, **overrides).save_pretrained(full)
    bare.mkdir()
    shutil.copy(full / "config.json", bare / "config.json")
    return full, bare


def loaded(folder):
    """The model read from its folder's weights (the tiny folders have no tokenizer for load_model)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def plan_doc(path) -> dict:
    data = json.loads(path.read_text())
    del data["provenance"]["created"]
    return data


def allocate_cli(folder, out, method: str, budget: str = "0.6", *extra: str) -> dict:
    main(["allocate", "--model", str(folder), "--budget", budget, "--method", method, "--output", str(out), *extra])
    return plan_doc(out)


@pytest.mark.parametrize("model_type,overrides", FAMILIES, ids=[f for f, _ in FAMILIES])
def test_config_alone_gives_the_plan_the_weights_give(model_type, overrides, tmp_path, capsys, counted):
    from allocmoe import model_fingerprint
    from allocmoe.integrations.vllm_plugin import _check_plan
    from allocmoe.routing.layout import load_plan

    full, bare = folders(tmp_path, model_type, overrides)
    plans = {}
    for method in CONFIG_METHODS:
        made = allocate_cli(full, tmp_path / f"{method}-full.json", method)
        plans[method] = tmp_path / f"{method}-bare.json"
        assert allocate_cli(bare, plans[method], method) == made, method
        assert (tmp_path / f"{method}-bare.json").read_text().split('"provenance"')[0] == \
            (tmp_path / f"{method}-full.json").read_text().split('"provenance"')[0]     # byte for byte
    assert counted == {"forward": 0, "loads": 0}
    assert "wrote" in capsys.readouterr().err
    model = loaded(full)
    fingerprint = model_fingerprint(model)
    if model_type in DENSE:
        assert fingerprint["moe_layers"] == DENSE[model_type]
    for method, path in plans.items():
        plan = load_plan(path, model)                     # the real model, weights and all, accepts it
        assert plan.model == fingerprint and sorted(plan.layers) == fingerprint["moe_layers"]
        _check_plan(plan, model.config, fingerprint["moe_layers"])


B = ["--budget", "0.5"]


@pytest.mark.parametrize("extra,reason", [
    ([*B, "--method", "lexi"], "method lexi"),
    ([*B, "--method", "top-p"], "method top-p"),
    ([*B, "--method", "naee"], "method naee"),
    (B, "method auto"),
    ([*B, "--method", "alloc-l"], "method alloc-l without a profile"),
    ([*B, "--method", "alloc-moe"], "method alloc-moe without a profile"),
    ([*B, "--method", "uniform", "--substitute"], "the substitute (--substitute)"),
    ([*B, "--method", "alloc-t", "--refine", "2"], "the refinement (--refine)"),
    (["--method", "uniform", "--target-ppl", "5%"], "a perplexity target (--target-ppl)"),
    (["--max-distinct-experts", "0.5"], "a latency budget (--max-distinct-experts)"),
], ids=["lexi", "top-p", "naee", "auto", "alloc-l", "alloc-moe", "substitute", "refine", "target", "distinct"])
def test_a_run_that_needs_the_weights_is_one_line_on_a_config_alone(extra, reason, tmp_path, capsys, counted):
    _, bare = folders(tmp_path, "qwen3_moe", {})
    capsys.readouterr()                     # saving the model's progress bar
    argv = ["allocate", "--model", str(bare), "--output", str(tmp_path / "p.json"), *extra]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exc.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"allocmoe: error: {bare} has no weights (config.json alone), and {reason}"), lines
    assert "; run allocate where the weights are, or use --method uniform, ascending, descending or alloc-t" \
        in lines[0]
    assert counted == {"forward": 0, "loads": 0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare", "full"]


def test_a_profile_plans_from_the_config_alone(tmp_path, tok, capsys, counted):
    """alloc-l and alloc-moe read the profile and the config: no weights needed where the plan is made."""
    from conftest import build_tiny

    from allocmoe import profile_sensitivity
    from allocmoe.core.files import atomic_write_json
    from allocmoe.texts import read_text

    model = build_tiny("qwen3_moe", vocab_size=len(tok))
    full, bare = tmp_path / "full", tmp_path / "bare"
    model.save_pretrained(full)
    bare.mkdir()
    shutil.copy(full / "config.json", bare)
    text, _ = read_text(None, "calibration")
    profile = tmp_path / "profile.json"
    atomic_write_json(profile, profile_sensitivity(model, tok, text, {"seq_len": 16, "calib_tokens": 64,
                                                                       "progress": False}))
    counted.update(forward=0, loads=0)
    for method in ("alloc-l", "alloc-moe"):
        made = allocate_cli(full, tmp_path / "a.json", method, "0.5", "--profile", str(profile))
        assert allocate_cli(bare, tmp_path / "b.json", method, "0.5", "--profile", str(profile)) == made
    assert counted == {"forward": 0, "loads": 0}


def test_the_python_api_plans_from_a_config_alone(tmp_path, counted):
    from allocmoe import AllocMoeError, allocate
    from allocmoe.models import inspect_model

    full, bare = folders(tmp_path, "deepseek_v2", {"num_hidden_layers": 4, "first_k_dense_replace": 2})
    spec = inspect_model(bare, require_weights=False)
    assert not spec.has_weights and inspect_model(full).has_weights
    bare_plans = {m: allocate("0.6", m, model=str(bare)).to_dict() for m in CONFIG_METHODS}
    spec_plans = {m: allocate("0.6", m, model=spec).to_dict() for m in CONFIG_METHODS}
    assert counted == {"forward": 0, "loads": 0}
    model = loaded(full)
    for method in CONFIG_METHODS:
        made = allocate("0.6", method, model=model).to_dict()
        for plan in (bare_plans[method], spec_plans[method]):
            assert {k: v for k, v in plan.items() if k != "provenance"} == \
                {k: v for k, v in made.items() if k != "provenance"}
    with pytest.raises(AllocMoeError, match=r"has no weights \(config.json alone\), and method lexi"):
        allocate("0.5", "lexi", model=bare)
    with pytest.raises(AllocMoeError, match="needs the model loaded, not its folder; pass model=allocmoe.load_model"):
        allocate("0.5", "lexi", model=full)
    with pytest.raises(AllocMoeError, match="needs a sensitivity profile"):
        allocate("0.5", "alloc-l", model=bare)
    # the weights are asked for only by the runs that need them: elsewhere a config alone is still refused
    with pytest.raises(AllocMoeError, match=r"has no weights \(no model.safetensors\); download or save"):
        inspect_model(bare)
    with pytest.raises(AllocMoeError, match=r"has no weights \(no model.safetensors\); download or save"):
        spec.load()
