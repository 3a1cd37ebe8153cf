"""Prometheus metrics of one API server: request latencies and tokens it saw, the cores' load.

Each API server has its own registry (tests run several in one process);
`/metrics` refreshes the cores' scheduler stats first, so running, waiting
and KV cache usage are those of the scrape, not of the last output.

With DP > 1 the coordinator publishes each core's counters, shown per dp_rank:
`vsup_engine_steps_total` (steps with a batch of requests), `vsup_engine_dummy_steps_total`
(--dp-lockstep: steps an idle rank ran beside a busy one) and `vsup_engine_requests_total`.

Several API servers (`--api-server-count`, DP > 1) share one port, and a scrape reaches one of them.
Under `vsup serve` they share `--metrics-dir` too: each keeps its counters and histograms in files there
(prometheus_client's multiprocess mode) and /metrics sums those of every API server, restarted ones
included, so a scrape shows the deployment's totals whichever answers, and a counter never goes back.
The gauges are the cores' and the supervisor's, the same from every API server, except
`vsup_api_server_requests_in_flight`: the answering API server's own.

Restarts: `vsup_restarts_total{role}`. Under `vsup serve` they come from the
supervisor's state.json (`--state-file`), which counts every role; without
it, the API server counts the engine cores it saw replaced (a Hello with a
new instance id) through `record_restart(role)`.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.api_server import supervisor_state
from engine.api_server.request_stream import RequestStream

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
               480.0, 960.0)
ROLES = ("api-server", "engine-core", "worker", "coordinator")


class Metrics:
    """The counters and histograms the generation routes feed, and the engine stats collector."""

    def __init__(self, client, state_file: str | None = None, supervisor_socket: str | None = None,
                 shared_dir: str | None = None):
        self.client = client
        self.state_file = state_file
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if shared_dir:  # the values live in files, and the registry sums every API server's at scrape time
            if values.ValueClass is values.MutexValue:  # (server.main sets it up)
                raise RuntimeError("--metrics-dir: prometheus_client was imported before its multiprocess "
                                   "directory was set")
            r.register(SharedFilesCollector(shared_dir))
            r = None
        self.time_to_first_token = Histogram(
            "vsup_time_to_first_token_seconds", "Time from request arrival to its first token.",
            buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "vsup_inter_token_latency_seconds", "Time between successive tokens of a request.",
            buckets=ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "vsup_e2e_request_latency_seconds", "Time from request arrival to its end.",
            buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vsup_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("vsup_generation_tokens", "Tokens generated.", registry=r)
        self.requests_finished = Counter("vsup_requests_finished", "Finished engine requests by reason.",
                                         ["finish_reason"], registry=r)
        self.restarts_seen = dict.fromkeys(ROLES, 0)  # every role shows, at 0, before its first restart
        self.registry.register(RestartsCollector(
            (lambda: supervisor_state.restarts_by_role(supervisor_state.read(state_file), ROLES)) if state_file
            else lambda: self.restarts_seen))
        if state_file:
            self.registry.register(IncidentsCollector(
                lambda: supervisor_state.incidents(supervisor_state.read(state_file))))
        self.registry.register(EngineStatsCollector(client))
        if supervisor_socket:
            self.registry.register(ProcessLoadCollector(supervisor_socket))

    # what the routes report

    def on_first_token(self, seconds: float) -> None:
        """A request's first token arrived `seconds` after the request."""
        self.time_to_first_token.observe(seconds)

    def on_inter_token(self, seconds: float, num_tokens: int) -> None:
        """`num_tokens` arrived together after `seconds`: each waited its share."""
        for _ in range(num_tokens):
            self.inter_token_latency.observe(seconds / num_tokens)

    def on_finish(self, stream: RequestStream, num_output_tokens: int, finish_reason: str) -> None:
        """A choice ended: its latency, its tokens, why."""
        self.e2e_request_latency.observe(max(0.0, time.time() - stream.arrival_time))
        self.prompt_tokens.inc(len(stream.prompt_token_ids))
        self.generation_tokens.inc(num_output_tokens)
        self.requests_finished.labels(finish_reason=finish_reason).inc()

    def record_restart(self, role: str, count: int = 1) -> None:
        """`role` (api-server, engine-core, worker, coordinator) was restarted `count` times;
        ignored under a supervisor, whose own count is the one shown."""
        if not self.state_file:
            self.restarts_seen[role] += count

    async def render(self) -> bytes:
        """The exposition text, with the cores' stats fetched now (those that answer within 1 s)."""
        try:
            await self.client.refresh_stats(timeout_s=1.0)
        except Exception:  # a scrape must answer even with no core reachable
            pass
        return generate_latest(self.registry)


class SharedFilesCollector(Collector):
    """The sum of every API server's counters and histograms in the files of `path` (prometheus_client's
    multiprocess mode). A file another API server is creating this instant is empty until it sizes it:
    it holds no value yet, so it is skipped rather than read."""

    def __init__(self, path: str):
        self.path = path

    def describe(self):
        return []  # (registering must not read the files: another API server may be creating one)

    def collect(self):
        return MultiProcessCollector.merge([f for f in glob.glob(os.path.join(self.path, "*.db")) if _sized(f)])


def _sized(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


class EngineStatsCollector(Collector):
    """Per-DP-rank gauges read at scrape time from the engine client."""

    def __init__(self, client):
        self.client = client

    def collect(self):
        running = GaugeMetricFamily("vsup_num_requests_running", "Requests in the core's running batch.",
                                    labels=["dp_rank"])
        waiting = GaugeMetricFamily("vsup_num_requests_waiting", "Requests waiting in the core's queue.",
                                    labels=["dp_rank"])
        kv_usage = GaugeMetricFamily("vsup_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).",
                                     labels=["dp_rank"])
        hit_rate = GaugeMetricFamily("vsup_prefix_cache_hit_rate", "Prefix cache hits over queried tokens.",
                                     labels=["dp_rank"])
        preemptions = CounterMetricFamily("vsup_num_preemptions", "Requests preempted for KV cache space.",
                                          labels=["dp_rank"])
        up = GaugeMetricFamily("vsup_engine_up", "1 when the DP rank's engine core is ready and heard from.",
                               labels=["dp_rank"])
        in_flight = GaugeMetricFamily("vsup_api_server_requests_in_flight",
                                      "This API server's unfinished requests on the DP rank.", labels=["dp_rank"])
        # counted by the cores, published by the coordinator (DP > 1): absent without one
        steps = CounterMetricFamily("vsup_engine_steps", "Steps the DP rank's engine core ran with a batch of "
                                    "requests.", labels=["dp_rank"])
        dummy_steps = CounterMetricFamily("vsup_engine_dummy_steps", "Dummy steps the DP rank ran with no request, "
                                          "to step with the other ranks (--dp-lockstep).", labels=["dp_rank"])
        requests = CounterMetricFamily("vsup_engine_requests", "Requests the DP rank's engine core took, from "
                                       "every API server (a resubmitted request counts again).", labels=["dp_rank"])
        ranks = self.client.ranks
        for dp_rank in sorted(ranks.ranks):
            label = [str(dp_rank)]
            up.add_metric(label, 1.0 if ranks.is_up(dp_rank) else 0.0)
            in_flight.add_metric(label, ranks.get(dp_rank).num_in_flight)
            counters = ranks.get(dp_rank).counters
            if counters is not None:
                for family, value in zip((steps, dummy_steps, requests), counters):
                    family.add_metric(label, value)
            stats = self.client.stats.get(dp_rank)
            if stats is None:
                continue
            running.add_metric(label, stats.num_running)
            waiting.add_metric(label, stats.num_waiting)
            kv_usage.add_metric(label, stats.kv_cache_usage)
            hit_rate.add_metric(label, stats.prefix_cache_hit_rate)
            preemptions.add_metric(label, stats.num_preemptions)
        yield from (running, waiting, kv_usage, hit_rate, preemptions, up, in_flight, steps, dummy_steps, requests)


class RestartsCollector(Collector):
    """`vsup_restarts_total{role}` at scrape time, from `counts()`: the supervisor's (its state.json), or
    else the engine-core restarts this API server saw, never summed over API servers (each saw them all)."""

    def __init__(self, counts: Callable[[], dict[str, int]]):
        self.counts = counts

    def collect(self):
        family = CounterMetricFamily("vsup_restarts", "Processes restarted, by role.", labels=["role"])
        for role, count in self.counts().items():
            family.add_metric([role], count)
        yield family


class IncidentsCollector(Collector):
    """`vsup_incidents_total{role, cause}`: the units that went down unasked since the supervisor started, by
    the role of the process that went first and the cause (oom, killed, crash, error, exit, hang, health)."""

    def __init__(self, counts: Callable[[], dict[tuple[str, str], int]]):
        self.counts = counts

    def collect(self):
        family = CounterMetricFamily("vsup_incidents", "Units that went down unasked, by role and cause.",
                                     labels=["role", "cause"])
        for (role, cause), count in sorted(self.counts().items()):
            family.add_metric([role, cause], count)
        yield family


class ProcessLoadCollector(Collector):
    """What each process of the tree is busy with, as `vsup ps` shows it, asked of the supervisor at scrape
    time: `vsup_process_busy_ratio{process, role, kind}` (the share of its last 2 s spent on `kind`: an API
    server's loop and tokenize, an engine core's step, a worker's forward) and
    `vsup_process_events_per_second{process, role, kind}` (the coordinator's waves)."""

    def __init__(self, control_socket: str):
        self.control_socket = control_socket

    def collect(self):
        busy = GaugeMetricFamily("vsup_process_busy_ratio", "Share of the process's last report window spent "
                                 "on a kind of work.", labels=["process", "role", "kind"])
        rates = GaugeMetricFamily("vsup_process_events_per_second", "Events per second in the process's last "
                                  "report window.", labels=["process", "role", "kind"])
        for name, load in sorted(supervisor_state.loads(self.control_socket).items()):
            for kind, share in (load.get("busy") or {}).items():
                busy.add_metric([name, str(load.get("role")), kind], float(share))
            for kind, rate in (load.get("rates") or {}).items():
                rates.add_metric([name, str(load.get("role")), kind], float(rate))
        yield from (busy, rates)
