"""`allocmoe export`: engine command lines for a plan, checked against hand-computed settings and
read back by their consumers (the plugin's own environment parser, a shell word split)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from allocmoe import allocate
from allocmoe.cli import main
from allocmoe.errors import AllocMoeError
from allocmoe.integrations.export import export_plan, global_k
from allocmoe.integrations.vllm_plugin import PluginConfig
from conftest import build_tiny


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """qwen3_moe tiny: 3 MoE layers, K = 4, full budget 12."""
    folder = tmp_path_factory.mktemp("plans")
    model = build_tiny("qwen3_moe")
    files = {}
    for name, budget, method in [("uniform6", 6, "uniform"), ("asc7", 7, "ascending"), ("at50", 0.5, "alloc-t"),
                                 ("full", 12, "uniform")]:
        files[name] = folder / f"{name}.json"
        allocate(budget, method, model=model).save(files[name])
    ds = build_tiny("deepseek_v2")
    files["ds_at"] = folder / "ds_at.json"
    allocate(0.5, "alloc-t", model=ds).save(files["ds_at"])
    files["ds_uniform"] = folder / "ds_uniform.json"
    allocate(0.5, "uniform", model=ds).save(files["ds_uniform"])
    return files


def split(script: str) -> tuple[dict[str, str], list[str]]:
    """The last line of a snippet as the shell reads it: leading NAME=value words, then argv."""
    words = shlex.split(script.strip().splitlines()[-1])
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


@pytest.mark.parametrize("name,expected_k", [("uniform6", 2), ("asc7", 2), ("at50", 2), ("full", 4)])
def test_global_k_is_the_largest_engine_wide_k_within_the_budget(plans, name, expected_k):
    from allocmoe import Plan

    plan = Plan.load(plans[name])
    k = global_k(plan)
    assert k == expected_k
    assert k * 3 <= plan.budget and (k == 4 or (k + 1) * 3 > plan.budget)


def test_global_engines_get_the_setting_and_say_what_is_lost(plans):
    exp = export_plan("vllm-global", {None: plans["asc7"]}, model="/models/q")
    env, argv = split(exp.script())
    assert env == {} and argv[:3] == ["vllm", "serve", "/models/q"]
    assert json.loads(argv[argv.index("--hf-overrides") + 1]) == {"num_experts_per_tok": 2}
    assert exp.activations_per_token == 6 and exp.full == 12
    text = "\n".join(exp.notes)
    assert "lost: per-layer k" in text and "k=3 would spend 9" in text and "token-level" not in text

    sg = export_plan("sglang", {None: plans["at50"]})
    _, argv = split(sg.script())
    assert json.loads(argv[argv.index("--json-model-override-args") + 1]) == {"num_experts_per_tok": 2}
    assert any("lost: the token-level policy (alloc-t)" in n for n in sg.notes)
    assert not any("per-layer" in n for n in sg.notes)       # alloc-t at 0.5: k = 2 in every layer

    ll = export_plan("llama.cpp", {None: plans["uniform6"]}, model="q.gguf")
    _, argv = split(ll.script())
    assert argv == ["llama-server", "-m", "q.gguf", "--override-kv", "qwen3moe.expert_used_count=int:2"]
    assert not any(n.startswith("lost") for n in ll.notes)
    ds = export_plan("llama.cpp", {None: plans["ds_uniform"]}, arch="custom")
    assert split(ds.script())[1][-1] == f"custom.expert_used_count=int:{ds.global_k}"


def test_vllm_plugin_env_reads_back_through_the_plugins_own_parser(plans):
    exp = export_plan("vllm", {None: plans["asc7"], "half": plans["at50"], "u": plans["uniform6"]}, model="m")
    env, argv = split(exp.script())
    assert argv == ["vllm", "serve", "m"]
    config = PluginConfig.from_env(env)
    assert config.default == plans["asc7"].resolve()
    assert config.named == {"half": plans["at50"].resolve(), "u": plans["uniform6"].resolve()}
    assert any("only the kept (token, expert) pairs" in n for n in exp.notes)     # several plans: how they run

    static = export_plan("vllm", {None: plans["asc7"]})
    assert any("saving is real" in n for n in static.notes) and static.activations_per_token == 7


def test_refusals_name_the_problem(plans):
    export_plan("vllm", {None: plans["ds_at"]})                 # the plugin restates DeepSeek's grouped top-k
    export_plan("vllm", {None: plans["ds_uniform"]})
    with pytest.raises(AllocMoeError, match="one engine-wide k"):
        export_plan("sglang", {None: plans["asc7"], "x": plans["at50"]})
    with pytest.raises(AllocMoeError, match="different models"):
        export_plan("vllm", {None: plans["asc7"], "ds": plans["ds_uniform"]})
    with pytest.raises(AllocMoeError, match="unknown export format"):
        export_plan("tgi", {None: plans["asc7"]})


def test_cli_writes_an_executable_snippet_and_refuses_bad_input(plans, tmp_path, capsys):
    out = tmp_path / "serve.sh"
    main(["export", "--format", "llama.cpp", "--plan", str(plans["uniform6"]), "--model", "q.gguf", "--output", str(out)])
    printed = capsys.readouterr().out
    assert out.read_text() == printed and printed.startswith("#!/usr/bin/env sh\n") and os.access(out, os.X_OK)
    main(["export", "--format", "vllm", "--plan", str(plans["asc7"]), "--json"])
    assert json.loads(capsys.readouterr().out)["env"]["ALLOCMOE_PLAN"] == str(plans["asc7"].resolve())

    bad = [(["--format", "vllm", "--plan", str(tmp_path / "none.json")], "plan file not found"),
           (["--format", "vllm", "--request-plan", "no name"], "NAME=PLAN.json"),
           (["--format", "sglang", "--plan", str(plans["asc7"]), "--request-plan", f"x={plans['at50']}"],
            "one engine-wide k"),
           (["--format", "vllm", "--plan", str(plans["asc7"]), "--output", str(tmp_path)], "is a folder")]
    for args, message in bad:
        with pytest.raises(SystemExit) as exit_info:
            main(["export", *args, "--output", str(tmp_path / "never.sh")] if "--output" not in args else ["export", *args])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "never.sh").exists()
    assert Path(out).exists()


def test_the_plugin_reads_the_moe_layers_from_the_config_alone_and_refuses_another_layout(plans):
    """vLLM's config check (before any weight loads) knows the MoE layers from the config: DeepSeek's
    first layer is dense here, so a plan for the same family with another layer count is refused."""
    from allocmoe.core.plan import Plan
    from allocmoe.integrations.vllm_plugin import _check_plan, _moe_layers_of

    ds = build_tiny("deepseek_v2")
    deeper = build_tiny("deepseek_v2", num_hidden_layers=4)
    assert _moe_layers_of(ds.config) == [1, 2] and _moe_layers_of(deeper.config) == [1, 2, 3]
    plan = Plan.load(plans["ds_uniform"])
    _check_plan(plan, ds.config, _moe_layers_of(ds.config))
    with pytest.raises(AllocMoeError, match="num_moe_layers is 2 in the plan but 3 in the served model"):
        _check_plan(plan, deeper.config, _moe_layers_of(deeper.config))
