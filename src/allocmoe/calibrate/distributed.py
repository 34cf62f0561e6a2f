"""Profiling and sweeping on Ray: the same cells and rows, spread over actors that each load the model once.

Not a scheduler of its own and not a second protocol: a worker runs the cells it is given with the
very code of the single-process profile (profile._ProfileRun, prefix cache included), so a cell's
number is the single-process one (bit for bit when workers and the single process use the same
torch thread count; a different count can change float sums in the matmuls).

Profile: the pending cells are grouped by MoE layer; a group goes to one idle actor, which computes the
states entering that layer once and streams back each cell as it finishes (a Ray streaming generator),
so the driver writes every finished cell into `<output>.partial.json` as it arrives and a killed
driver resumes from it. A worker that dies (its process killed, its node lost) is replaced by a fresh
actor, placed wherever the cluster has room, and only the cells of its group that had not come back
are sent again: nothing finished is lost or recomputed.

Sweep: each (budget, method) row is a task on an actor holding the model; a row whose worker dies is
sent again to a replacement.

Addresses: None or 'local' starts a local Ray instance; 'auto' joins the cluster RAY_ADDRESS names (or the
one running on this node); anything else ('ray://head:10001', 'head:6379') is passed to ray.init.
Nothing here assumes one machine: the model goes to workers as its folder path, which every node
must be able to read (a shared file system, or the same path on each node).
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..errors import AllocMoeError

INSTALL_HINT = "--ray needs Ray; pip install 'allocmoe[ray]'"
MAX_REPLACEMENTS = 3          # per worker slot: a cluster that kills workers faster than this is refused


def check_ray() -> None:
    """Refuse before any work when Ray is not installed."""
    if importlib.util.find_spec("ray") is None:
        raise AllocMoeError(INSTALL_HINT)


@dataclass
class RaySettings:
    address: str | None = None         # None/'local' = start a local instance; 'auto' = RAY_ADDRESS or this node's cluster
    workers: int | None = None         # actors; None = the cluster's CPUs // threads_per_worker
    threads_per_worker: int = 1        # torch threads in each actor (and CPUs it reserves)


def connect(settings: RaySettings) -> tuple[bool, int]:
    """ray.init as `settings.address` says; (whether this call started Ray, workers to start)."""
    import ray

    started = False
    if not ray.is_initialized():
        address = None if settings.address in (None, "", "local") else settings.address
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address is None:           # a local instance: as many CPUs as the workers asked for, else all
            kwargs["num_cpus"] = (settings.workers * settings.threads_per_worker if settings.workers
                                  else os.cpu_count())
        try:
            ray.init(address=address, **kwargs)
        except Exception as exc:          # Ray raises ConnectionError, ValueError, RuntimeError... for a bad address
            where = f"the Ray cluster at {address}" if address else "a local Ray instance"
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise AllocMoeError(f"cannot start or join {where} ({first}); check --ray ADDRESS (or RAY_ADDRESS "
                                "for auto), or give --ray with no value for a local instance") from None
        started = True
    cpus = int(ray.cluster_resources().get("CPU", 1))
    workers = settings.workers or max(1, cpus // settings.threads_per_worker)
    return started, workers


def _load_model(model_path: str, trust_remote_code: bool, threads: int):
    torch.set_num_threads(threads)
    from ..models import inspect_model

    spec = inspect_model(model_path, trust_remote_code=trust_remote_code)
    model, tokenizer = spec.load()
    return model, tokenizer


class _ProfileWorker:
    """Holds one loaded model; runs groups of cells of one MoE layer, yielding each as it finishes."""

    def __init__(self, model_path: str, trust_remote_code: bool, threads: int, windows, config, fingerprint):
        self.model, self.tokenizer = _load_model(model_path, trust_remote_code, threads)
        self.windows, self.config, self.fingerprint = windows, config, fingerprint

    def ready(self) -> int:
        return os.getpid()

    def cells(self, group: list[tuple[int, ...]]):
        from .profile import _ProfileRun

        run = _ProfileRun(self.model, self.tokenizer, self.windows, self.config, self.fingerprint, group)
        try:
            for configuration, ppl in run.cells(_NoBar()):
                yield ("cell", configuration, ppl, os.getpid())
        finally:
            run.release()
        yield ("facts", run.provenance(), None, os.getpid())


class _NoBar:
    """The bar a worker's run reports to: nothing shows; the driver has the bar."""
    work_total = work_done = 0

    def set_postfix_str(self, *args, **kwargs) -> None:
        pass


class RayProfileRun:
    """The passes of a profile run on Ray, with the interface of profile._ProfileRun: `cells(bar)`
    yields (configuration, perplexity) as cells come back, in whatever order they finish."""

    def __init__(self, spec, windows: torch.Tensor, config, fingerprint: dict[str, Any], todo: list[tuple[int, ...]],
                 settings: RaySettings):
        import ray

        from .prefix import start_position

        self.settings, self.todo = settings, todo
        self.k_orig = fingerprint["k_orig"]
        groups: dict[int, list[tuple[int, ...]]] = {}
        for configuration in todo:                       # one group per MoE layer: its states computed once
            groups.setdefault(start_position(configuration, self.k_orig), []).append(configuration)
        self.groups = [groups[layer] for layer in sorted(groups)]
        self.started_ray, workers = connect(settings) if todo else (False, 0)
        try:                                             # a Ray this run started never outlives a failed setup
            self.workers = min(workers, len(self.groups))
            self.facts = {"prefix_cache": config.prefix_cache, "layer_passes": 0, "naive_layer_passes": 0,
                          "peak_cache_bytes": 0}
            self.replacements, self.pids = 0, set()
            self.worker_class = ray.remote(num_cpus=settings.threads_per_worker, max_restarts=0,
                                           max_task_retries=0)(_ProfileWorker)
            worker_config = type(config)(**{**config.__dict__, "progress": False, "ray": None})
            self.args = (str(spec.path), bool(getattr(spec, "trust_remote_code", False)),
                         settings.threads_per_worker, ray.put(windows) if todo else None, worker_config, fingerprint)
        except BaseException:
            self.release()
            raise

    def planned_passes(self) -> int:
        return 0          # the bar's time left then counts cells (the groups run side by side)

    def cells(self, bar) -> Iterator[tuple[tuple[int, ...], float]]:
        import ray

        pending = list(self.groups)                      # groups (or their unfinished rests) not yet sent
        idle = [self.worker_class.remote(*self.args) for _ in range(self.workers)]
        busy: dict[Any, tuple[Any, list[tuple[int, ...]]]] = {}     # generator -> (actor, cells not back yet)
        try:
            while pending or busy:
                while pending and idle:
                    actor, group = idle.pop(), pending.pop(0)
                    busy[actor.cells.remote(group)] = (actor, list(group))
                bar.set_postfix_str(f"workers busy {len(busy)}/{self.workers}", refresh=False)
                ready, _ = ray.wait(list(busy), num_returns=1)
                generator = ready[0]
                actor, left = busy[generator]
                try:
                    kind, payload, ppl, pid = ray.get(next(generator))
                except StopIteration:
                    del busy[generator]
                    idle.append(actor)
                    continue
                except ray.exceptions.RayTaskError as exc:
                    raise _raised_in_worker(exc) from None
                except _dead_worker_errors() as exc:
                    del busy[generator]
                    self.replacements += 1
                    if self.replacements > MAX_REPLACEMENTS * self.workers:
                        cause = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                        raise AllocMoeError(f"Ray workers keep dying ({self.replacements} replaced; last: {cause}); "
                                            "the finished cells are kept in the partial file, rerun to resume") from None
                    ray.kill(actor)
                    pending.insert(0, left)              # only the cells that had not come back
                    idle.append(self.worker_class.remote(*self.args))
                    continue
                self.pids.add(pid)
                if kind == "facts":
                    for name in ("layer_passes", "naive_layer_passes"):
                        self.facts[name] += payload[name]
                    self.facts["peak_cache_bytes"] = max(self.facts["peak_cache_bytes"], payload["peak_cache_bytes"])
                    self.facts["prefix_cache"] = self.facts["prefix_cache"] and payload["prefix_cache"]
                    if payload.get("prefix_cache_refused"):
                        self.facts["prefix_cache_refused"] = payload["prefix_cache_refused"]
                    self.facts["decoder_layers"] = payload["decoder_layers"]
                    continue
                configuration = tuple(payload)
                left.remove(configuration)
                yield configuration, ppl
        finally:
            for generator, (actor, _) in busy.items():
                ray.kill(actor)
            for actor in idle:
                ray.kill(actor)

    def release(self) -> None:
        import ray

        if self.started_ray:
            ray.shutdown()
            self.started_ray = False

    def provenance(self) -> dict[str, Any]:
        """The work the workers reported (a group cut short by a dead worker is not counted), and how the
        run was spread: workers, threads each, workers replaced."""
        return {**self.facts, "ray": {"address": self.settings.address or "local", "workers": self.workers,
                                      "threads_per_worker": self.settings.threads_per_worker,
                                      "workers_replaced": self.replacements,
                                      "worker_processes": len(self.pids)}}


class _SweepWorker:
    """Holds one loaded model; scores the full model or one (budget, method) row of a sweep."""

    def __init__(self, model_path: str, trust_remote_code: bool, threads: int, work):
        self.model, self.tokenizer = _load_model(model_path, trust_remote_code, threads)
        self.work = work

    def run(self, item):
        if item[0] == "full":
            return self.work.full(self.model, self.tokenizer)
        _, budget, method = item
        return self.work.row(self.model, self.tokenizer, budget, method, None)


def ray_rows(spec, tokenizer, work, pairs: list, settings: RaySettings, workers: int, bar):
    """The full model's figures and every (budget, method) row of a sweep, each a task on an actor that
    holds the model; a task whose worker dies goes to a replacement. Returns (full, full task scores,
    [(row, plan key, plan dict)] in the order of `pairs`)."""
    import ray

    from ..measure.sweep import relative_change

    worker_class = ray.remote(num_cpus=settings.threads_per_worker, max_restarts=0, max_task_retries=0)(_SweepWorker)
    args = (str(spec.path), bool(getattr(spec, "trust_remote_code", False)), settings.threads_per_worker,
            ray.put(work))
    items = [("full",)] + [(index, budget, method) for index, (budget, method) in enumerate(pairs)]
    workers = min(workers, len(items))
    idle = [worker_class.remote(*args) for _ in range(workers)]
    busy: dict[Any, tuple[Any, tuple]] = {}
    results: dict[Any, Any] = {}
    replaced = 0
    try:
        while items or busy:
            while items and idle:
                actor, item = idle.pop(), items.pop(0)
                busy[actor.run.remote(item)] = (actor, item)
            bar.set_postfix_str(f"workers busy {len(busy)}/{workers}", refresh=False)
            bar.refresh()
            ready, _ = ray.wait(list(busy), num_returns=1)
            actor, item = busy.pop(ready[0])
            try:
                results[item[0]] = ray.get(ready[0])
            except ray.exceptions.RayTaskError as exc:
                raise _raised_in_worker(exc) from None
            except _dead_worker_errors() as exc:
                replaced += 1
                if replaced > MAX_REPLACEMENTS * workers:
                    raise AllocMoeError(f"Ray workers keep dying ({replaced} replaced; last: "
                                        f"{type(exc).__name__}); rerun the sweep") from None
                ray.kill(actor)
                items.insert(0, item)
                idle.append(worker_class.remote(*args))
                continue
            idle.append(actor)
            if item[0] != "full":
                bar.update(1)
    finally:
        for actor, _ in busy.values():
            ray.kill(actor)
        for actor in idle:
            ray.kill(actor)
    full, full_tasks = results.pop("full")
    done = [results[index] for index in range(len(pairs))]
    for row, _, _ in done:
        row["relative_change"] = relative_change(row["perplexity"], full)
    return full, full_tasks, done


def _dead_worker_errors() -> tuple[type[Exception], ...]:
    """What ray.get raises when the worker itself went (killed, crashed, its result lost): rerun elsewhere."""
    import ray

    return (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError)


def _raised_in_worker(exc) -> Exception:
    """An error the worker's own code raised, as one line: its AllocMoeError as it was, else 'a Ray worker failed'."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, AllocMoeError):
        return AllocMoeError(str(cause))
    what = f"{type(cause).__name__}: {_first_line(cause)}" if cause is not None else _first_line(exc)
    return RuntimeError(f"a Ray worker failed ({what})")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
