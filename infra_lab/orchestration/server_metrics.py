"""The server's Prometheus metrics, in a registry of its own (several servers may live in one
test process). Names follow vLLM's `vllm:` metrics with the prefix `infra_lab_`: latency
histograms (TTFT, inter-token, end to end), what the engine holds when scraped (running and
waiting requests, KV blocks in use), counters of tokens, preemptions and requests by outcome,
the weight version, how long weight swaps paused the engine, and how many steps an abort took.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                     1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
STEP_BUCKETS = (0, 1, 2, 3, 5, 10)


class ServerMetrics:
    def __init__(self, model: str, num_blocks: int):
        self.registry = registry = CollectorRegistry()
        labels = {"model_name": model}
        self.labels = labels

        def make(kind, name, about, **extra):
            return kind(f"infra_lab_{name}", about, list(labels), registry=registry, **extra).labels(**labels)

        self.ttft_s = make(Histogram, "time_to_first_token_seconds", "Time to first token, from the request's "
                           "arrival at the server", buckets=LATENCY_BUCKETS_S)
        self.itl_s = make(Histogram, "inter_token_latency_seconds", "Time between two tokens of a request",
                          buckets=LATENCY_BUCKETS_S)
        self.e2e_s = make(Histogram, "e2e_request_latency_seconds", "From arrival to the last token",
                          buckets=LATENCY_BUCKETS_S)
        self.running = make(Gauge, "num_requests_running", "Requests holding a place in the running batch")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests submitted that have not run yet")
        self.blocks_used = make(Gauge, "kv_blocks_used", "KV blocks in use (a prefix cache's blocks included)")
        self.blocks_total = make(Gauge, "kv_blocks_total", "KV blocks in the pool")
        self.num_blocks = num_blocks
        self.blocks_total.set(num_blocks)
        self.preemptions = make(Counter, "num_preemptions", "Requests preempted")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of requests that ended")
        self.cached_tokens = make(Counter, "prefix_cache_hit_tokens", "Prompt tokens a prefix cache served")
        self.generation_tokens = make(Counter, "generation_tokens", "Tokens generated")
        self.weight_version = make(Gauge, "weight_version", "The version of the weights now serving")
        self.weight_swap_s = make(Histogram, "weight_swap_seconds", "Pause a weight update put between two steps",
                                  buckets=LATENCY_BUCKETS_S)
        self.abort_steps = make(Histogram, "abort_delay_steps", "Engine steps between a client's disconnect "
                                "(or an abort) and the engine freeing the request", buckets=STEP_BUCKETS)
        self._requests = Counter("infra_lab_requests", "Requests by outcome: stop, length, abort, rejected (429), "
                                 "invalid (4xx), error (5xx)", list(labels) + ["outcome"], registry=registry)

    def outcome(self, outcome: str) -> None:
        self._requests.labels(**self.labels, outcome=outcome).inc()

    def watch(self, loop) -> None:
        """Read the gauges from `loop` (an EngineLoop) at each scrape: lengths and counts only, which
        another thread may read while the loop's thread steps."""
        scheduler, pool = loop.engine.scheduler, loop.engine.blocks.pool
        self.running.set_function(lambda: len(scheduler.running))
        self.waiting.set_function(lambda: loop.waiting)
        self.blocks_used.set_function(lambda: pool.allocator.num_blocks - pool.num_free)
        self.weight_version.set_function(lambda: loop.engine.weight_version)

    def on_step(self, record) -> None:
        """After each engine step (EngineLoop's on_step, in the loop's thread)."""
        if record.preempted:
            self.preemptions.inc(len(record.preempted))

    def text(self) -> bytes:
        return generate_latest(self.registry)
