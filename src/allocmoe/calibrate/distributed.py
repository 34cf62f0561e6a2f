"""Profiling and sweeping on Ray: the same cells and rows, spread over actors that each load the model once.

Not a scheduler of its own and not a second protocol: a worker runs what it is given with the very
code of the single process (profile.cell_run, prefix cache included, and sweep._RowWork), so a
cell's or a row's number is the single-process one (bit for bit when workers and the single process
use the same torch thread count; a different count can change float sums in the matmuls).

One pool (RayPool) runs both: each actor loads the model once and holds a job (the profile's or the
sweep's fixed inputs); an item sent to an idle actor streams back each result as it finishes (a Ray
streaming generator). A worker that dies (its process killed, its node lost) is replaced by a fresh
actor, placed wherever the cluster has room, and only the part of its item whose results had not
come back is sent again: nothing finished is lost or recomputed.

Profile: an item is the pending cells of one MoE layer, the states entering that layer computed once
per item; the driver writes every finished cell into `<output>.partial.json` as it arrives, so a
killed driver resumes from it. Sweep: an item is the full model or one (budget, method) row.

Addresses: None or 'local' starts a local Ray instance; 'auto' joins the cluster RAY_ADDRESS names (or the
one running on this node); anything else ('ray://head:10001', 'head:6379') is passed to ray.init.
Nothing here assumes one machine: the model goes to workers as its folder path, which every node
must be able to read (a shared file system, or the same path on each node).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..core.config import replaced
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
            raise AllocMoeError(f"cannot start or join {where} ({_first_line(exc)}); check --ray ADDRESS (or "
                                "RAY_ADDRESS for auto), or give --ray with no value for a local instance") from None
        started = True
    cpus = int(ray.cluster_resources().get("CPU", 1))
    workers = settings.workers or max(1, cpus // settings.threads_per_worker)
    return started, workers


class _ModelWorker:
    """A Ray actor: loads the model once, holds a job, and runs the job's items, streaming back each
    result (with this process's id, so the driver can count the processes that did the work)."""

    def __init__(self, model_path: str, trust_remote_code: bool, threads: int, job):
        torch.set_num_threads(threads)
        from ..models import inspect_model

        self.model, self.tokenizer = inspect_model(model_path, trust_remote_code=trust_remote_code).load()
        self.job = job

    def run(self, item):
        for result in self.job.run(self.model, self.tokenizer, item):
            yield os.getpid(), result


class ProfileWorker(_ModelWorker):
    """A worker holding a profile's job (its processes are titled `ray::ProfileWorker`)."""


class SweepWorker(_ModelWorker):
    """A worker holding a sweep's job (its processes are titled `ray::SweepWorker`)."""


class RayPool:
    """Actors of `worker_class` that each hold the model and `job` (an object with `run(model,
    tokenizer, item)`, a generator of results); `results` sends items to idle actors and yields (item,
    result) as results arrive, in whatever order they finish, replacing any worker that dies."""

    def __init__(self, worker_class: type[_ModelWorker], spec, job, settings: RaySettings, workers: int,
                 rerun_hint: str):
        import ray

        self.settings, self.most_workers, self.rerun_hint = settings, workers, rerun_hint
        self.worker_class = ray.remote(num_cpus=settings.threads_per_worker, max_restarts=0,
                                       max_task_retries=0)(worker_class)
        self.args = (str(spec.path), bool(getattr(spec, "trust_remote_code", False)), settings.threads_per_worker,
                     ray.put(job))
        self.workers = self.replaced = 0
        self.pids: set[int] = set()

    def results(self, items: list, rest: Callable[[Any, list], Any], bar) -> Iterator[tuple[Any, Any]]:
        """(item, result) for every result of every item. `rest(item, results back so far)` is what a
        dead worker's item still needs (None or empty: nothing): it is sent again, first, to a new actor.
        The bar shows `workers busy n/N`."""
        import ray

        pending = list(items)
        self.workers = min(self.most_workers, len(pending))
        idle = [self.worker_class.remote(*self.args) for _ in range(self.workers)]
        busy: dict[Any, tuple[Any, Any, list]] = {}      # generator -> (actor, item, results back)
        try:
            while pending or busy:
                while pending and idle:
                    actor, item = idle.pop(), pending.pop(0)
                    busy[actor.run.remote(item)] = (actor, item, [])
                bar.set_postfix_str(f"workers busy {len(busy)}/{self.workers}", refresh=False)
                bar.refresh()
                ready, _ = ray.wait(list(busy), num_returns=1)
                generator = ready[0]
                actor, item, back = busy[generator]
                try:
                    pid, result = ray.get(next(generator))
                except StopIteration:
                    del busy[generator]
                    idle.append(actor)
                    continue
                except ray.exceptions.RayTaskError as exc:
                    raise _raised_in_worker(exc) from None
                except _dead_worker_errors() as exc:
                    del busy[generator]
                    self._replace(actor, exc)
                    left = rest(item, back)
                    if left:
                        pending.insert(0, left)
                    idle.append(self.worker_class.remote(*self.args))
                    continue
                self.pids.add(pid)
                back.append(result)
                yield item, result
        finally:
            for actor, _, _ in busy.values():
                ray.kill(actor)
            for actor in idle:
                ray.kill(actor)

    def _replace(self, actor, exc: Exception) -> None:
        import ray

        ray.kill(actor)                                  # what is left of it: a crashed worker may linger
        self.replaced += 1
        if self.replaced > MAX_REPLACEMENTS * self.workers:
            raise AllocMoeError(f"Ray workers keep dying ({self.replaced} replaced; last: {_last_line(exc)}); "
                                f"{self.rerun_hint}") from None

    def provenance(self) -> dict[str, Any]:
        """How the work was spread: address, workers, threads each, workers replaced, processes that worked."""
        return {"address": self.settings.address or "local", "workers": self.workers,
                "threads_per_worker": self.settings.threads_per_worker, "workers_replaced": self.replaced,
                "worker_processes": len(self.pids)}


class _ProfileJob:
    """A profile worker's fixed inputs; an item is a group of cells of one MoE layer, run by the
    single-process code (`cell_run`, profile.cell_run: handed in, so this module stays below the
    profile that uses it), yielding ("cell", (configuration, perplexity)) as each finishes, then
    ("facts", the work it counted)."""

    def __init__(self, windows: torch.Tensor, config, fingerprint: dict[str, Any], cell_run: Callable):
        self.windows, self.config, self.fingerprint, self.cell_run = windows, config, fingerprint, cell_run

    def run(self, model, tokenizer, group: list[tuple[int, ...]]):
        run = self.cell_run(model, tokenizer, self.windows, self.config, self.fingerprint, group)
        try:
            for configuration, ppl in run.cells(_NoBar()):
                yield "cell", (configuration, ppl)
        finally:
            run.release()
        yield "facts", run.provenance()

    @staticmethod
    def rest(group: list[tuple[int, ...]], back: list) -> list[tuple[int, ...]]:
        """The cells of a dead worker's group that had not come back."""
        finished = {tuple(payload[0]) for kind, payload in back if kind == "cell"}
        return [configuration for configuration in group if configuration not in finished]


class _NoBar:
    """The bar a worker's run reports to: nothing shows; the driver has the bar."""
    work_total = work_done = 0

    def set_postfix_str(self, *args, **kwargs) -> None:
        pass


class RayProfileRun:
    """The passes of a profile run on Ray, with the interface of cells.CellRun: `cells(bar)`
    yields (configuration, perplexity) as cells come back, in whatever order they finish. Each
    worker runs its cells with `cell_run` (profile.cell_run), which travels to it by name."""

    def __init__(self, spec, windows: torch.Tensor, config, fingerprint: dict[str, Any], todo: list[tuple[int, ...]],
                 settings: RaySettings, cell_run: Callable):
        from .prefix import start_position

        groups: dict[int, list[tuple[int, ...]]] = {}
        for configuration in todo:                       # one group per MoE layer: its states computed once
            groups.setdefault(start_position(configuration, fingerprint["k_orig"]), []).append(configuration)
        self.groups = [groups[layer] for layer in sorted(groups)]
        self.settings, self.pool = settings, None
        self.facts = {"prefix_cache": config.prefix_cache, "layer_passes": 0, "naive_layer_passes": 0,
                      "peak_cache_bytes": 0}
        self.started_ray, workers = connect(settings) if todo else (False, 0)
        try:                                             # a Ray this run started never outlives a failed setup
            if todo:
                worker_config = replaced(config, progress=False, ray=None, ray_workers=None, threads_per_worker=1)
                job = _ProfileJob(windows, worker_config, fingerprint, cell_run)
                self.pool = RayPool(ProfileWorker, spec, job, settings, workers,
                                    "the finished cells are kept in the partial file, rerun to resume")
        except BaseException:
            self.release()
            raise

    def planned_passes(self) -> int:
        return 0          # the bar's time left then counts cells (the groups run side by side)

    def cells(self, bar) -> Iterator[tuple[tuple[int, ...], float]]:
        if self.pool is None:
            return
        for _, (kind, payload) in self.pool.results(self.groups, _ProfileJob.rest, bar):
            if kind == "cell":
                configuration, ppl = payload
                yield tuple(configuration), ppl
                continue
            for name in ("layer_passes", "naive_layer_passes"):
                self.facts[name] += payload[name]
            self.facts["peak_cache_bytes"] = max(self.facts["peak_cache_bytes"], payload["peak_cache_bytes"])
            self.facts["prefix_cache"] = self.facts["prefix_cache"] and payload["prefix_cache"]
            if payload.get("prefix_cache_refused"):
                self.facts["prefix_cache_refused"] = payload["prefix_cache_refused"]
            self.facts["decoder_layers"] = payload["decoder_layers"]

    def release(self) -> None:
        import ray

        if self.started_ray:
            ray.shutdown()
            self.started_ray = False

    def provenance(self) -> dict[str, Any]:
        """The work the workers reported (a group cut short by a dead worker is not counted), and how the
        run was spread: workers, threads each, workers replaced."""
        spread = (self.pool.provenance() if self.pool is not None else
                  {"address": self.settings.address or "local", "workers": 0,
                   "threads_per_worker": self.settings.threads_per_worker, "workers_replaced": 0,
                   "worker_processes": 0})
        return {**self.facts, "ray": spread}


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


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__
