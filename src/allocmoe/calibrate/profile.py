"""Allocation-isolating sensitivity profiling (Alloc-L's offline step). Slow; resumable.

For MoE layer i and k in 1..K_orig the model runs with layers before i at K_orig, layer i at k and
every deeper layer at top-1, and the calibration perplexity is recorded as S[i][k]. Forcing deeper
layers to top-1 stops them compensating for layer i. Layer i at k=1 is the configuration of layer
i-1 at K_orig, so those L-1 cells are measured once: L*K - (L-1) perplexity runs in all.

Prefix cache (ProfileConfig.prefix_cache, on by default): before layer i every cell of layer i runs
the unmodified model, so the hidden states entering layer i are computed once and each cell runs
only from there (calibrate/prefix.py); the states of one layer are held at a time. The numbers are
the naive ones (bit for bit on CPU); a model that cannot start a pass at a layer exactly is
profiled the naive way, every cell a full pass, with a warning. Work is counted in decoder-layer
passes (tokens x decoder layers) and recorded beside what the naive protocol runs for the same cells.

Models bigger than memory (ProfileConfig.max_memory, given with the model's folder): the pending
cells walk the model layer by layer, each layer read once per group of cells that fits the cap
(calibrate/walk.py, calibrate/onload.py), to the same numbers; a model that fits is loaded whole.

Resuming: after every cell the finished cells are written atomically to `<output>.partial.json`
with the arguments that produced them and the model's weights fingerprint (core/fingerprint.py); a
rerun with the same arguments and weights skips them (recomputing the held states up to the first
unfinished layer in one pass), so a run killed at any point recomputes at most the cell it was in.
A partial file of other weights or settings is not resumed, and one warning line says why. An
interrupt raises errors.Interrupted, which names the cells kept.

Profile file (format_version 1): {"format_version", "model": fingerprint with "weights", "k_orig", "num_layers",
"metric": "perplexity", "calibration": {...}, "sensitivity": [[S[i][k] for k in 1..K] ...],
"provenance": {...}}; the typed document is in core/formats.py, its JSON Schema in
docs/schemas/profile.schema.json. Provenance of this run: configurations_run (all) and
configurations_resumed (finished by an earlier run), prefix_cache (asked for and never refused)
and prefix_cache_refused (why it was), layer_passes and naive_layer_passes (this run's cells),
decoder_layers, peak_cache_bytes (hidden states held at once), seconds_this_run, config; with a cap,
layer_by_layer, weight_reads (per decoder layer, max, embedding, head), weight_bytes_read and memory
(cap, planned peak, least cap, model bytes, walks, cells per walk).
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..routing.apply import static_plan
from ..core.config import Config, check_counts, checked_config
from ..errors import AllocMoeError, Interrupted
from ..scoring.perplexity import check_batch_size, window_len, evaluate_perplexity, tokenize_windows
from ..core.files import atomic_write_json, read_json
from ..core.formats import PROFILE_FORMAT_VERSION as FORMAT_VERSION
from ..core.formats import ProfileDocument, validated
from ..core.fingerprint import same_weights, weights_fingerprint
from ..core.plan import check_fingerprint
from ..routing.layout import model_fingerprint
from .onload import OnloadedModel
from .cells import CellBar, CellRun
from .prefix import profile_start_layer, start_position
from .walk import WalkRun, memory_plan, whole_model_facts



class ProfileConfig(Config):
    """How the sensitivity profile is measured: calibration windows, batching, and where it runs."""
    __config_aliases__ = {"max_tokens": "calib_tokens", "batch_size": "windows_per_pass"}   # deprecated names

    seq_len: int | None = None     # calibration window; None = min(2048, the model's position limit)
    calib_tokens: int = 8192       # calibration tokens scored per configuration (the paper does not say)
    windows_per_pass: int = 4      # windows per forward pass
    progress: bool = True          # show a progress bar with cells done and time left
    prefix_cache: bool = True      # start each cell at its layer from states computed once: same numbers, half the work
    max_memory: int | str | None = None   # bytes or '300MiB': a model bigger than memory, read layer by layer
    ray: str | None = None         # fan cells out on Ray: 'local' starts an instance, 'auto' or an address joins one
    ray_workers: int | None = None  # Ray actors, each holding the model; None = the cluster's CPUs // threads
    threads_per_worker: int = 1    # torch threads (and Ray CPUs) per actor

    def __post_init__(self):
        if self.ray is not None and self.max_memory is not None:      # each worker would need its own walk
            raise AllocMoeError("--ray and --max-memory cannot be combined yet; profile a model bigger than "
                                "memory in one process (--max-memory), or one that fits on Ray (--ray)")
        check_ray_fields(self, "ProfileConfig")
        if self.max_memory is not None:
            from .walk import parse_size

            self.max_memory = parse_size(self.max_memory)
        check_counts(self, {"seq_len": 2, "calib_tokens": 2, "windows_per_pass": 1})


def check_ray_fields(config, owner: str) -> None:
    """The Ray fields of a ProfileConfig or SweepConfig, before any work: Ray installed when `ray` is
    given, whole counts >= 1, and the counts only with `ray` (they would do nothing without it)."""
    if config.ray is None:
        if config.ray_workers is not None:
            raise AllocMoeError(f"ray_workers (--ray-workers) is {config.ray_workers!r} but ray (--ray) is not given; "
                                "add --ray to run on Ray workers, or drop --ray-workers")
        if config.threads_per_worker != 1:
            raise AllocMoeError(f"{owner}.threads_per_worker is {config.threads_per_worker!r} but ray (--ray) is not "
                                "given; set ray to run on Ray workers, or leave threads_per_worker at 1")
        return
    from .distributed import check_ray

    check_ray()
    check_counts(config, {"ray_workers": 1, "threads_per_worker": 1},
                 {"ray_workers": "--ray-workers", "threads_per_worker": f"{owner}.threads_per_worker"})


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
    """Profile every (layer, k) cell; returns the profile dict (also written to `output` if given).

    `model` is a loaded model, or a model folder (its path, or the ModelSpec of `inspect_model`), which
    is then loaded here; `tokenizer` None takes the folder's. With `config.max_memory` it must be a
    folder: a model that fits under the cap is loaded whole, a bigger one is read layer by layer
    (calibrate/walk.py), and a cap too small for that is refused before any weight is read."""
    config = checked_config(ProfileConfig, config)
    _check_arguments(model, tokenizer, calib_text, output, calib_name, on_cell)
    spec = model_folder(model, config)
    if spec is not None:
        tokenizer = tokenizer if tokenizer is not None else spec.tokenizer()
        model = spec.skeleton()                      # the layout, no weights: loaded below once the work is known
    fingerprint = with_weights(model_fingerprint(model), spec if spec is not None else model)
    num_layers, k_orig = fingerprint["num_moe_layers"], fingerprint["k_orig"]
    windows, calibration = _calibration(model, tokenizer, calib_text, calib_name, config)
    run_key = {"model": fingerprint, "calibration": calibration}

    partial_path = Path(f"{output}.partial.json") if output else None
    done = resumed_cells(partial_path, run_key) if partial_path else {}
    configs = profile_cells(num_layers, k_orig)
    todo = [cfg for cfg in configs if _key(cfg) not in done]

    started, onloaded = time.time(), None
    if config.ray is not None:
        run = _ray_run(spec, windows, config, fingerprint, todo)
    elif spec is not None and todo:
        model, onloaded, run = _folder_run(spec, tokenizer, windows, config, fingerprint, todo)
    else:
        run = cell_run(model, tokenizer, windows, config, fingerprint, todo)
    bar = CellBar(total=len(configs), initial=len(configs) - len(todo), desc="profile", unit="cell",
                  bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]",
                  disable=not config.progress, work_total=run.planned_passes())
    try:
        score_cells(run, bar, done, partial_path, run_key, len(configs),
                    on_cell=(lambda cfg: on_cell(*configs[cfg][0])) if on_cell else None)
    finally:
        bar.close()
        run.release()
        if onloaded is not None:
            onloaded.release()

    sensitivity = [[0.0] * k_orig for _ in range(num_layers)]
    for cfg, filled in configs.items():
        for layer, k in filled:
            sensitivity[layer][k - 1] = done[_key(cfg)]
    profile = {
        "format_version": FORMAT_VERSION, "model": fingerprint, "k_orig": k_orig, "num_layers": num_layers,
        "metric": "perplexity", "calibration": calibration, "sensitivity": sensitivity,
        "provenance": {"configurations_run": len(configs), "configurations_resumed": len(configs) - len(todo),
                       "seconds_this_run": round(time.time() - started, 1), "config": config.model_dump(),
                       "torch_threads": config.threads_per_worker if config.ray is not None else torch.get_num_threads(),
                       **run.provenance()},
    }
    if output:
        atomic_write_json(output, profile)
        if partial_path and partial_path.exists():
            partial_path.unlink()
    return profile


def _calibration(model, tokenizer, calib_text: str, calib_name: str, config: ProfileConfig):
    """(windows, the profile's `calibration` facts): the text cut into windows, refused when too short
    for a window, for --calib-tokens (beyond the default's "up to") or for --windows-per-pass. The
    file keeps its keys `max_tokens` and `batch_size` (formats.Calibration)."""
    default = ProfileConfig.model_fields["calib_tokens"].default      # "up to": a shorter text is fine
    windows = tokenize_windows(tokenizer, calib_text, window_len(model, config.seq_len), config.calib_tokens,
                               beyond=None if config.calib_tokens == default else "calib_tokens (--calib-tokens)")
    check_batch_size(windows, config.windows_per_pass)
    return windows, {"text": calib_name, "sha256": hashlib.sha256(calib_text.encode()).hexdigest()[:16],
                     "tokens_scored": int(windows.numel() - windows.size(0)), "windows": int(windows.size(0)),
                     "seq_len": int(windows.size(1)), "max_tokens": config.calib_tokens,
                     "batch_size": config.windows_per_pass}


def score_cells(run, bar, done: dict[str, float], partial_path, run_key, total: int, what: str = "cells",
                on_cell=None) -> None:
    """Take each cell's perplexity as it arrives into `done`, kept in the partial (resume) file after
    each, then `on_cell(cell)`; a Ctrl-C with cells kept becomes Interrupted, naming them (the
    sensitivity profile's and the distinct-expert profile's cells alike)."""
    arrivals = run.cells(bar)
    try:
        for cell, ppl in arrivals:
            done[_key(cell)] = ppl
            if partial_path:
                atomic_write_json(partial_path, {"key": run_key, "cells": done})
            bar.update(1)
            if on_cell:
                on_cell(cell)
    except KeyboardInterrupt as exc:
        if partial_path is None or not done or isinstance(exc, Interrupted):
            raise
        raise Interrupted(f"{len(done)} of {total} {what} kept in {partial_path}") from exc
    finally:
        arrivals.close()                             # its workers stop before Ray does


def _check_arguments(model, tokenizer, calib_text, output, calib_name, on_cell) -> None:
    """profile_sensitivity's arguments at the door, before any work: types, the text, and an `output`
    that could not be written at the end (a folder, or a path under a file; a missing folder is made
    when the profile is written): the CLI's messages."""
    from pathlib import Path

    from ..core.config import check_argument, check_model_argument, check_tokenizer_argument
    from ..models import ModelSpec
    from ..core.outputs import check_output_file, refuse_under_a_file
    from ..texts import check_text

    check_model_argument("profile_sensitivity", model, folder=(ModelSpec,))
    check_tokenizer_argument("profile_sensitivity", tokenizer,
                             optional=not (isinstance(model, torch.nn.Module)))
    check_text(calib_text, "profile_sensitivity: calib_text")
    check_argument("profile_sensitivity", "output", output, str | os.PathLike | None, "a file path")
    check_argument("profile_sensitivity", "calib_name", calib_name, str)
    if on_cell is not None and not callable(on_cell):
        raise AllocMoeError(f"profile_sensitivity: on_cell must be a function (layer, k), got "
                            f"{type(on_cell).__name__}; give a function or None")
    if output is not None and (Path(output).is_dir() or Path(output).parent.exists()):
        check_output_file(str(output))
    elif output is not None:
        refuse_under_a_file(Path(output), "--output")


def model_folder(model, config: ProfileConfig):
    """The ModelSpec of a model given as a folder (path or ModelSpec); None for a loaded model."""
    from ..models import ModelSpec, inspect_model

    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, (str, os.PathLike)):
        return inspect_model(model)
    if config.ray is not None:
        raise AllocMoeError("ray (--ray) needs the model's folder, not a loaded model, so that each worker loads "
                            "it once; pass the folder: profile_sensitivity('path/to/model', None, text, "
                            "{'ray': 'local'}); allocmoe.models.inspect_model() gives the built-in model's")
    if config.max_memory is not None:
        raise AllocMoeError("max_memory (--max-memory) needs the model's folder, not a loaded model, so that its "
                            "weights are read a layer at a time; pass the folder: "
                            "profile_sensitivity('path/to/model', None, text, {'max_memory': '300MiB'})")
    return None


def _folder_run(spec, tokenizer, windows: torch.Tensor, config: ProfileConfig, fingerprint: dict[str, Any],
                todo: list[tuple[int, ...]]):
    """(model, onloaded model or None, run) for a model folder: loaded as usual without a cap; under a
    cap, read whole when it fits and layer by layer when it does not (a cap too small is refused here,
    before any weight is read)."""
    if config.max_memory is None:
        model, _ = spec.load()
        return model, None, cell_run(model, tokenizer, windows, config, fingerprint, todo)
    onloaded = OnloadedModel(spec)
    plan = memory_plan(onloaded, windows, config.windows_per_pass, config.max_memory)
    if plan.fits():
        for name in onloaded.pieces:
            onloaded.load(name)
        return onloaded.model, onloaded, cell_run(onloaded.model, tokenizer, windows, config, fingerprint, todo,
                                                  facts=whole_model_facts(onloaded, plan))
    plan.check()
    return onloaded.model, onloaded, WalkRun(onloaded, windows, config, fingerprint, todo, plan)


def _ray_run(spec, windows: torch.Tensor, config: ProfileConfig, fingerprint: dict[str, Any],
             todo: list[tuple[int, ...]]):
    """The cells on Ray actors that each load the folder's model once (calibrate/distributed.py)."""
    from .distributed import RayProfileRun, RaySettings

    settings = RaySettings(address=config.ray, workers=config.ray_workers, threads_per_worker=config.threads_per_worker)
    return RayProfileRun(spec, windows, config, fingerprint, todo, settings, cell_run)


def _key(configuration: tuple[int, ...]) -> str:
    return ",".join(map(str, configuration))


def cell_run(model, tokenizer, windows: torch.Tensor, config: ProfileConfig, fingerprint: dict[str, Any],
             todo: list[tuple[int, ...]], facts: dict[str, Any] | None = None) -> CellRun:
    """The profile's cells on a loaded model (cells.py): each configuration starts at its first MoE
    layer below K_orig and is scored by the perplexity evaluation, unchanged."""
    moe_layers, k_orig = fingerprint["moe_layers"], fingerprint["k_orig"]
    ppl_config = {"windows_per_pass": config.windows_per_pass, "progress": False}
    return CellRun(
        model, windows, config.windows_per_pass, todo, prefix_cache=config.prefix_cache, facts=facts,
        start_layer=profile_start_layer(moe_layers, k_orig),
        plan_for=lambda cfg: static_plan(model, list(cfg), method="profile"),
        score=lambda: evaluate_perplexity(model, tokenizer, "", ppl_config, windows=windows).perplexity,
        label=lambda cfg: f"MoE layer {start_position(cfg, k_orig) + 1}/{len(moe_layers)}")


def with_weights(fingerprint: dict[str, Any], model) -> dict[str, Any]:
    """The shape fingerprint with the model's weights fingerprint added as "weights" (a model folder's
    files, or a model in memory's tensors: core/fingerprint.py), when there is one."""
    weights = weights_fingerprint(model)
    return {**fingerprint, "weights": weights} if weights else fingerprint


def why_not_resumed(saved: Any, run_key: dict[str, Any]) -> str:
    """Why a saved key is not this run's, for the warning: "another model's weights", "another
    model", "no weights fingerprint (an older allocmoe)", "other settings (calibration)"."""
    if not isinstance(saved, dict):
        return "an unknown key"
    found, wanted = saved.get("model"), run_key.get("model")
    if found != wanted and isinstance(found, dict) and isinstance(wanted, dict):
        shape = [key for key in set(found) | set(wanted) if key != "weights" and found.get(key) != wanted.get(key)]
        if not shape:
            if not found.get("weights"):
                return "no weights fingerprint (an older allocmoe)"
            return "another model's weights" if same_weights(found.get("weights"), wanted.get("weights")) is False \
                else "weights fingerprinted another way (a folder's files against tensors in memory)"
        return f"another model ({', '.join(sorted(shape))})"
    fields = sorted(key for key in set(saved) | set(run_key) if saved.get(key) != run_key.get(key))
    return f"other settings ({', '.join(fields)})"


def resumed_cells(partial_path: Path, run_key: dict[str, Any], what: str = "partial profile") -> dict[str, float]:
    """Finished cells of an earlier run with the same key (model and its weights, calibration, ...);
    none if it differs (one warning line says why it was not resumed) or is damaged. The
    distinct-expert profile (distinct.py) resumes through it too."""
    if not partial_path.is_file():
        return {}
    try:
        saved = read_json(partial_path, what)
        if isinstance(saved, dict) and isinstance(saved.get("cells"), dict) and saved.get("key") != run_key:
            print(f"allocmoe: warning: {partial_path} was not resumed: its cells were made with "
                  f"{why_not_resumed(saved.get('key'), run_key)}; profiling from the start", file=sys.stderr)
            return {}
        cells = {str(k): float(v) for k, v in saved["cells"].items()}
        if all(math.isfinite(v) for v in cells.values()):
            return cells
    except (AllocMoeError, KeyError, TypeError, ValueError, AttributeError):
        pass
    print(f"allocmoe: warning: {partial_path} is damaged; profiling from the start", file=sys.stderr)
    return {}


def load_profile(path: str | os.PathLike, model=None) -> dict[str, Any]:
    """Read and check a profile file; with `model`, refuse a profile of another model: another shape
    (core/plan.py) or other weights (a fingerprint of the same kind that differs). A profile with no
    weights fingerprint (made before allocmoe recorded it) is accepted with one warning line."""
    profile = checked_profile(read_json(path, "profile"), f"profile {path}")
    if model is not None:
        check_fingerprint(profile["model"], model_fingerprint(model), f"profile {path}")
        check_weights(profile["model"].get("weights"), weights_fingerprint(model), f"profile {path}")
    return profile


def check_weights(found: str | None, expected: str | None, what: str) -> None:
    """Refuse a file whose weights fingerprint differs from the model's, as another shape is refused;
    warn once for a file without one; say nothing when the two cannot be compared (files against
    tensors in memory, or the model's weights unknown)."""
    if same_weights(found, expected) is False:
        raise AllocMoeError(f"{what} was made for another model: its weights differ ({found} in the file, "
                            f"{expected} for this model); recreate it for this model with `allocmoe profile`")
    if found is None and expected is not None:
        print(f"allocmoe: warning: {what} records no weights fingerprint (made before allocmoe recorded one), "
              "so it cannot be checked against this model's weights; profile again to have it checked",
              file=sys.stderr)


def checked_profile(data: Any, source: str = "the profile") -> dict[str, Any]:
    """A profile document (from a file or built in Python) validated field by field, as a plain dict."""
    doc = validated(ProfileDocument, data, source, FORMAT_VERSION, "create it again with `allocmoe profile`")
    return doc.model_dump()
