"""Profiles are keyed by the model's weights, not only its shape (core/fingerprint.py): a fine-tune of
the same shape does not resume another model's cells or a sweep's rows or profile, and a finished
profile of other weights is refused as another shape is; old profiles without the field still load,
with a warning. File hashes are computed once and cached by (path, size, mtime)."""

import json
import os

import pytest
import torch

from allocmoe.calibrate.profile import load_profile, profile_cells, profile_sensitivity
from allocmoe.core import fingerprint
from allocmoe.errors import AllocMoeError
from conftest import KillAfter, build_tiny

TEXT = " ".join(f"word{i % 37} and thing{i % 11}." for i in range(400))
CFG = {"seq_len": 32, "calib_tokens": 256, "windows_per_pass": 3, "progress": False}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Every test hashes into a cache of its own, never the user's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "allocmoe" / "weights.json"


def tiny(tok):
    return build_tiny("deepseek_v2", vocab_size=len(tok), num_hidden_layers=4, max_position_embeddings=256)


def fine_tuned(model):
    """The same shape, other weights: every expert nudged, as a fine-tune would."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name or "gate_up" in name or "down_proj" in name:
                param.mul_(1.5)
    return model


def test_a_fine_tune_does_not_resume_another_models_cells_and_a_warning_says_why(tok, tmp_path, capsys):
    base = tiny(tok)
    out = tmp_path / "profile.json"
    with pytest.raises(KeyboardInterrupt):
        profile_sensitivity(base, tok, TEXT, CFG, output=out, on_cell=KillAfter(4))
    tuned = fine_tuned(tiny(tok))
    reference = profile_sensitivity(tuned, tok, TEXT, CFG)
    capsys.readouterr()
    ran = []
    profile = profile_sensitivity(tuned, tok, TEXT, CFG, output=out, on_cell=lambda layer, k: ran.append(1))
    err = capsys.readouterr().err
    assert f"allocmoe: warning: {out}.partial.json was not resumed: its cells were made with another model's " \
           "weights; profiling from the start" in err, err
    assert len(ran) == len(profile_cells(3, 4))                        # every cell of the fine-tune ran
    assert profile["provenance"]["configurations_resumed"] == 0
    assert profile["sensitivity"] == reference["sensitivity"]
    assert profile["model"]["weights"].startswith("tensors:")


def test_the_same_weights_still_resume(tok, tmp_path, capsys):
    model = tiny(tok)
    out = tmp_path / "profile.json"
    with pytest.raises(KeyboardInterrupt):
        profile_sensitivity(model, tok, TEXT, CFG, output=out, on_cell=KillAfter(4))
    profile = profile_sensitivity(tiny(tok), tok, TEXT, CFG, output=out)      # rebuilt: the same tensors
    assert profile["provenance"]["configurations_resumed"] == 4
    assert "warning" not in capsys.readouterr().err


@pytest.fixture
def two_folders(tok, tmp_path):
    """Two model folders of one shape: a base model and its fine-tune."""
    folders = []
    for name, model in (("base", tiny(tok)), ("tuned", fine_tuned(tiny(tok)))):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
        folders.append(tmp_path / name)
    return folders


def test_a_profile_of_other_weights_is_refused_as_another_shape_is(two_folders, tmp_path):
    from allocmoe.models import inspect_model, load_model

    base, tuned = two_folders
    out = tmp_path / "base.json"
    profile = profile_sensitivity(str(base), None, TEXT, CFG, output=out)
    assert profile["model"]["weights"].startswith("files:")
    assert json.loads(out.read_text())["model"]["weights"] == profile["model"]["weights"]
    for model in (load_model(base)[0], inspect_model(base).skeleton()):
        assert load_profile(out, model)["model"]["weights"] == profile["model"]["weights"]
    for model in (load_model(tuned)[0], inspect_model(tuned).skeleton()):
        with pytest.raises(AllocMoeError, match=r"was made for another model: its weights differ \(files:\w+ in the "
                                                r"file, files:\w+ for this model\); recreate it"):
            load_profile(out, model)


def test_the_cli_refuses_a_profile_of_other_weights_with_exit_2(two_folders, tmp_path, capsys):
    from allocmoe.cli import main

    base, tuned = two_folders
    out = tmp_path / "base.json"
    profile_sensitivity(str(base), None, TEXT, CFG, output=out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["allocate", "--model", str(tuned), "--profile", str(out), "--budget", "0.5", "--method", "alloc-l",
              "--output", str(tmp_path / "plan.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"allocmoe: error: profile {out} was made for another model: its "
                                               "weights differ"), err
    assert not (tmp_path / "plan.json").exists()


def test_an_old_profile_without_weights_loads_with_one_warning(two_folders, tmp_path, capsys):
    from allocmoe.models import load_model

    base, _ = two_folders
    out = tmp_path / "base.json"
    profile = profile_sensitivity(str(base), None, TEXT, CFG, output=out)
    old = json.loads(out.read_text())
    del old["model"]["weights"]
    out.write_text(json.dumps(old))
    capsys.readouterr()
    assert load_profile(out, load_model(base)[0])["sensitivity"] == profile["sensitivity"]
    err = capsys.readouterr().err
    assert err.count("allocmoe: warning:") == 1 and "records no weights fingerprint" in err, err
    assert load_profile(out)["model"]["weights"] is None                 # without a model: nothing to check


def test_files_are_hashed_once_and_again_when_they_change(two_folders, own_cache, monkeypatch):
    base, _ = two_folders
    hashed = []
    original = fingerprint.file_sha256

    def counting(path, cache):
        digest, now = original(path, cache)
        hashed.append(now)
        return digest, now
    monkeypatch.setattr(fingerprint, "file_sha256", counting)
    first = fingerprint.folder_weights(base)
    assert hashed == [True] and own_cache.is_file()
    assert fingerprint.folder_weights(base) == first and hashed == [True, False]     # from the cache
    weights = base / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))               # touched: hashed again
    assert fingerprint.folder_weights(base) == first and hashed[-1] is True
    own_cache.write_text("not json")                                                 # a broken cache: hashed again
    assert fingerprint.folder_weights(base) == first and hashed[-1] is True


def test_a_model_in_memory_is_hashed_by_its_tensors_and_a_change_in_place_is_seen(tok):
    model = tiny(tok)
    before = fingerprint.weights_fingerprint(model)
    assert before.startswith("tensors:") and fingerprint.weights_fingerprint(tiny(tok)) == before
    with torch.no_grad():
        next(model.parameters())[0, 0] += 1.0
    assert fingerprint.weights_fingerprint(model) != before
    assert fingerprint.same_weights(before, "files:0123456789abcdef") is None        # kinds that cannot be compared
    assert fingerprint.same_weights(before, None) is None


def test_a_sweep_does_not_reuse_the_profile_or_rows_of_other_weights(tok, tmp_path, capsys):
    from allocmoe.pipelines.sweep import sweep

    config = {"budgets": ("1/2",), "methods": ("uniform", "alloc-l"), "eval_tokens": 96, "seq_len": 32,
              "progress": False, "profile": {"calib_tokens": 256}}
    out = tmp_path / "sweep"

    def stop(method, fraction):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        sweep(tiny(tok), tok, TEXT, TEXT, config, output_dir=out, on_row=stop)
    assert (out / "profile.json").is_file() and (out / "rows.partial.json").is_file()
    capsys.readouterr()
    tuned = fine_tuned(tiny(tok))
    results = sweep(tuned, tok, TEXT, TEXT, config, output_dir=out)
    err = capsys.readouterr().err
    assert f"{out / 'profile.json'} was not reused: it was made with another model's weights; profiling again" in err
    assert f"{out / 'rows.partial.json'} was not resumed: its rows were made with another model's weights" in err
    fresh = sweep(tuned, tok, TEXT, TEXT, config, output_dir=tmp_path / "fresh")
    assert results["rows"] == fresh["rows"] and results["full"] == fresh["full"]
