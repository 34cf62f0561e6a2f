"""Prometheus metrics of one server (its own registry, so several apps in a process do not mix).

Names follow vLLM's where one exists (`num_requests_running`, time to first token, end-to-end
latency); plan-specific ones are allocmoe's own. The plan label is the plan's name, `full` for the
unmodified model, and `none` for requests refused before a plan was chosen. A budget plan's series
go when the plan leaves the server's cache (`forget`), so they stay as few as the cached plans.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from .engine import StepStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
disable_created_metrics()      # no `*_created` timestamp series: half the page, and no scraper here reads them


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("allocmoe_requests", "Requests answered, by plan and HTTP status",
                                ["plan", "status"], registry=r)
        self.prompt_tokens = Counter("allocmoe_prompt_tokens", "Prompt tokens prefilled", ["plan"], registry=r)
        self.generation_tokens = Counter("allocmoe_generation_tokens", "Tokens generated", ["plan"], registry=r)
        self.activations = Counter("allocmoe_activations", "Routed (token, expert) pairs over all MoE layers",
                                   ["plan"], registry=r)
        self.routed_tokens = Counter("allocmoe_routed_tokens", "Tokens that went through the MoE layers",
                                     ["plan"], registry=r)
        self.activations_per_token = Gauge("allocmoe_activations_per_token",
                                           "Measured activations per token over all finished requests of the plan",
                                           ["plan"], registry=r)
        self.full_activations = Gauge("allocmoe_full_activations_per_token",
                                      "The unmodified model's activations per token (L x K)", registry=r)
        self.batch_size = Histogram("allocmoe_batch_size", "Rows per forward pass", ["kind"],
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.mixed_batches = Counter("allocmoe_mixed_plan_batches",
                                     "Forward passes whose batch held more than one plan", registry=r)
        self.running = Gauge("allocmoe_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("allocmoe_num_requests_waiting", "Requests waiting for a slot", registry=r)
        self.ttft = Histogram("allocmoe_time_to_first_token_seconds", "Submit to first token", ["plan"],
                              registry=r)
        self.latency = Histogram("allocmoe_e2e_request_latency_seconds", "Submit to last token", ["plan"],
                                 registry=r)
        self.step_seconds = Histogram("allocmoe_step_seconds", "Measured seconds of a forward pass", ["kind"],
                                      buckets=(.005, .01, .025, .05, .075, .1, .15, .2, .3, .5, .75, 1, 2, 5),
                                      registry=r)
        self.tpot = Histogram("allocmoe_time_per_output_token_seconds", "Measured seconds from one decode step "
                              "to the next of a running batch (prefill passes between included)",
                              buckets=(.005, .01, .025, .05, .075, .1, .15, .2, .3, .5, .75, 1, 2, 5), registry=r)
        # --latency-target-ms: the controller's last decision
        self.elastic_target = Gauge("allocmoe_elastic_target_seconds", "The decode step time the server holds",
                                    registry=r)
        self.elastic_budget = Gauge("allocmoe_elastic_activations_per_token",
                                    "Planned activations per token of the ladder rung in force", registry=r)
        self.elastic_predicted = Gauge("allocmoe_elastic_predicted_step_seconds",
                                       "Predicted seconds of the last decode step (NaN: nothing measured yet)",
                                       registry=r)
        self.elastic_measured = Gauge("allocmoe_elastic_measured_step_seconds",
                                      "Measured seconds of the last decode step (its time per output "
                                      "token; the pass alone after an idle batch)", registry=r)
        self._totals: dict[str, list[float]] = {}
        self._statuses: dict[str, set[str]] = {}          # plan -> statuses counted (to forget them)

    def count(self, plan: str, status: str) -> None:
        self.requests.labels(plan, status).inc()
        self._statuses.setdefault(plan, set()).add(status)

    def forget(self, plan: str) -> None:
        """Drop a plan's series: a budget plan evicted from the server's cache. Without this every budget
        a client ever asked for kept ~40 series, and the /metrics page (and memory) grew without bound."""
        for status in self._statuses.pop(plan, ()):
            self.requests.remove(plan, status)
        for metric in (self.prompt_tokens, self.generation_tokens, self.activations, self.routed_tokens,
                       self.activations_per_token, self.ttft, self.latency):
            try:
                metric.remove(plan)
            except KeyError:                # never observed for this plan
                pass
        self._totals.pop(plan, None)

    def on_pass(self, step: StepStats) -> None:
        self.batch_size.labels(step.kind).observe(step.rows)
        self.step_seconds.labels(step.kind).observe(step.seconds)
        if step.interval is not None:
            self.tpot.observe(step.interval)
        if step.plans > 1:
            self.mixed_batches.inc()

    def elastic_step(self, activations: float, predicted: float | None, measured: float) -> None:
        self.elastic_budget.set(activations)
        self.elastic_predicted.set(float("nan") if predicted is None else predicted)
        self.elastic_measured.set(measured)

    def finished(self, plan: str, prompt_tokens: int, new_tokens: int, activations: float, routed: int,
                 ttft: float | None, latency: float | None) -> None:
        self.prompt_tokens.labels(plan).inc(prompt_tokens)
        self.generation_tokens.labels(plan).inc(new_tokens)
        self.activations.labels(plan).inc(activations)
        self.routed_tokens.labels(plan).inc(routed)
        total = self._totals.setdefault(plan, [0.0, 0.0])
        total[0] += activations
        total[1] += routed
        if total[1]:
            self.activations_per_token.labels(plan).set(total[0] / total[1])
        if ttft is not None:
            self.ttft.labels(plan).observe(ttft)
        if latency is not None:
            self.latency.labels(plan).observe(latency)

    def render(self, running: int, waiting: int) -> bytes:
        self.running.set(running)
        self.waiting.set(waiting)
        return generate_latest(self.registry)
