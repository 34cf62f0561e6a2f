"""Allocation-isolating sensitivity profiling (Alloc-L's offline step). Slow; resumable.

For MoE layer i and k in 1..K_orig the model runs with layers before i at K_orig, layer i at k and
every deeper layer at top-1, and the calibration perplexity is recorded as S[i][k]. Forcing deeper
layers to top-1 stops them compensating for layer i. Layer i at k=1 is the configuration of layer
i-1 at K_orig, so those L-1 cells are measured once: L*K - (L-1) perplexity runs in all.

Resuming: after every cell the finished cells are written atomically to `<output>.partial.json`
with the arguments that produced them; a rerun with the same arguments skips them, so a run killed
at any point recomputes at most the cell it was in.

Profile file (format_version 1): {"format_version", "model": fingerprint, "k_orig", "num_layers",
"metric": "perplexity", "calibration": {...}, "sensitivity": [[S[i][k] for k in 1..K] ...],
"provenance": {...}}; the typed document is in core/formats.py, its JSON Schema in
docs/schemas/profile.schema.json.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from ..routing.apply import apply_plan, static_plan
from ..core.config import checked_config
from ..errors import AllocMoeError
from ..measure.evaluate.perplexity import window_len, evaluate_perplexity, tokenize_windows
from ..core.files import atomic_write_json, read_json
from ..core.formats import PROFILE_FORMAT_VERSION as FORMAT_VERSION
from ..core.formats import ProfileDocument, validated
from ..core.plan import check_fingerprint, model_fingerprint



@dataclass
class ProfileConfig:
    seq_len: int | None = None     # calibration window; None = min(2048, the model's position limit)
    max_tokens: int = 8192         # calibration tokens scored per configuration (the paper does not say)
    batch_size: int = 4            # windows per forward pass
    progress: bool = True          # show a progress bar with cells done and time left

    def __post_init__(self):
        for name in ("seq_len", "max_tokens", "batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 2):
                raise AllocMoeError(f"{name.replace('_', '-')} must be a whole number >= 2, got {value!r}")


def layer_configuration(layer: int, k: int, num_layers: int, k_orig: int) -> tuple[int, ...]:
    """k per MoE layer for cell (layer, k): K_orig before, k at `layer`, 1 after."""
    return tuple([k_orig] * layer + [k] + [1] * (num_layers - layer - 1))


def profile_cells(num_layers: int, k_orig: int) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """Distinct configurations to run, each with the (layer, k) cells it fills."""
    cells: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for layer in range(num_layers):
        for k in range(1, k_orig + 1):
            cells.setdefault(layer_configuration(layer, k, num_layers, k_orig), []).append((layer, k))
    return cells


def profile_sensitivity(model, tokenizer, calib_text: str, config: ProfileConfig | dict | None = None,
                        output: str | os.PathLike | None = None, calib_name: str = "text",
                        on_cell: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Profile every (layer, k) cell; returns the profile dict (also written to `output` if given)."""
    config = checked_config(ProfileConfig, config)
    fingerprint = model_fingerprint(model)
    num_layers, k_orig = fingerprint["num_moe_layers"], fingerprint["k_orig"]
    seq_len = window_len(model, config.seq_len)
    windows = tokenize_windows(tokenizer, calib_text, seq_len, config.max_tokens)
    calibration = {"text": calib_name, "sha256": hashlib.sha256(calib_text.encode()).hexdigest()[:16],
                   "tokens_scored": int(windows.numel() - windows.size(0)), "windows": int(windows.size(0)),
                   "seq_len": int(windows.size(1)), "max_tokens": config.max_tokens, "batch_size": config.batch_size}
    run_key = {"model": fingerprint, "calibration": calibration}

    partial_path = Path(f"{output}.partial.json") if output else None
    done = _resumed_cells(partial_path, run_key) if partial_path else {}

    configs = profile_cells(num_layers, k_orig)
    todo = [cfg for cfg in configs if ",".join(map(str, cfg)) not in done]
    started = time.time()
    bar = tqdm(total=len(configs), initial=len(configs) - len(todo), desc="profile", unit="cell",
               disable=not config.progress)
    ppl_config = {"batch_size": config.batch_size, "progress": False}
    for cfg in todo:
        with apply_plan(model, static_plan(model, list(cfg), method="profile")):
            ppl = evaluate_perplexity(model, tokenizer, "", ppl_config, windows=windows).perplexity
        done[",".join(map(str, cfg))] = ppl
        if partial_path:
            atomic_write_json(partial_path, {"key": run_key, "cells": done})
        bar.update(1)
        if on_cell:
            on_cell(*configs[cfg][0])
    bar.close()

    sensitivity = [[0.0] * k_orig for _ in range(num_layers)]
    for cfg, filled in configs.items():
        for layer, k in filled:
            sensitivity[layer][k - 1] = done[",".join(map(str, cfg))]
    profile = {
        "format_version": FORMAT_VERSION, "model": fingerprint, "k_orig": k_orig, "num_layers": num_layers,
        "metric": "perplexity", "calibration": calibration, "sensitivity": sensitivity,
        "provenance": {"configurations_run": len(configs), "seconds_this_run": round(time.time() - started, 1),
                       "config": asdict(config), "torch_threads": torch.get_num_threads()},
    }
    if output:
        atomic_write_json(output, profile)
        if partial_path and partial_path.exists():
            partial_path.unlink()
    return profile


def _resumed_cells(partial_path: Path, run_key: dict[str, Any]) -> dict[str, float]:
    """Finished cells of an earlier run with the same model and calibration; none if it differs or is damaged."""
    if not partial_path.is_file():
        return {}
    try:
        saved = read_json(partial_path, "partial profile")
        if not (isinstance(saved, dict) and saved.get("key") == run_key):
            return {}
        cells = {str(k): float(v) for k, v in saved["cells"].items()}
        if all(math.isfinite(v) for v in cells.values()):
            return cells
    except (AllocMoeError, KeyError, TypeError, ValueError, AttributeError):
        pass
    print(f"allocmoe: warning: {partial_path} is damaged; profiling from the start", file=sys.stderr)
    return {}


def load_profile(path: str | os.PathLike, model=None) -> dict[str, Any]:
    """Read and check a profile file; with `model`, refuse a profile of another model."""
    profile = checked_profile(read_json(path, "profile"), f"profile {path}")
    if model is not None:
        check_fingerprint(profile["model"], model_fingerprint(model), f"profile {path}")
    return profile


def checked_profile(data: Any, source: str = "the profile") -> dict[str, Any]:
    """A profile document (from a file or built in Python) validated field by field, as a plain dict."""
    doc = validated(ProfileDocument, data, source, FORMAT_VERSION, "create it again with `allocmoe profile`")
    return doc.model_dump()
