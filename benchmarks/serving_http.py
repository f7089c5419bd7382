"""Chapter 06's figures: the engine behind HTTP (`infra-lab serve`), measured by the load
generator (`infra-lab bench serve`) and through the router (`infra-lab route`), with the book's
target model on this machine's CPU. Sections:

- overhead: one ShareGPT-like batch, all at once (saturation), served by the engine loop in this
  process and over HTTP (a server process, every request streamed); output tokens/s of each, in
  turns over rounds. The target: HTTP keeps at least 85% of the loop's throughput.
- latency: the same workload as a Poisson stream at several rates through HTTP: TTFT, TPOT and
  ITL percentiles, throughput, and every request's TTFT and TPOT (the chapter's CDFs).
- overload: Poisson arrivals at 3x the saturating rate (overhead's HTTP request rate) for 60 s
  against a server with a queue of 64: every request must get tokens or a 429 (no timeout, no
  5xx), the server's resident memory is sampled each second, and afterwards no KV block is used.
- disconnects: 100 streams cut at random points, ten at a time: each must leave the engine within
  one step (the server's abort_delay_steps histogram), and no block stays in use.
- router: two workers (one thread each, the radix prefix cache) behind the router, the
  shared-prefix workload at a fixed rate, each policy in turn over rounds: prefix hit rate and
  mean TTFT. Target: cache-aware at least 1.5x round robin's hit rate, with a lower mean TTFT.
  Then a worker is killed mid-run: no request that had not started streaming may fail.
- tenants: a well-behaved tenant's p99 TTFT alone, then beside a tenant sending 10x its quota,
  through the router. Target: within 1.5x of alone, and the flood gets 429s.
- reload: 10 in-place weight reloads under steady load (the pause each put between two steps,
  and the whole reload), and 2 rolling updates through the router; zero failed requests, every
  rolling-update response from one weight version. Target: a pause under 100 ms.
- explorer: policy x workload x rate through the router, for the chapter's explorer.

    python benchmarks/serving_http.py [--quick] [--only SECTION] [--json PATH]
"""
from __future__ import annotations

import os

# The engine loop in this process runs as `infra-lab serve` runs it: one BLAS thread, fixed before
# numpy loads (OpenBLAS's idle threads would spin on a core the engine needs).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import asyncio  # noqa: E402
import json
import math
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from infra_lab.orchestration import bench_metrics, launch, loadgen

sys.path.insert(0, str(Path(__file__).parent))
from engine_core import median_interval, run_sections, section_parser  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "serving_http.json"
SECTIONS = ("overhead", "latency", "overload", "disconnects", "router", "tenants", "reload", "explorer")
FULL = {"requests": 64, "rounds": 7, "rates": (0.25, 0.5, 0.75, 1.0, 1.25), "latency_requests": 48, "overload_s": 60.0,
        "streams": 100, "router_requests": 96, "router_rounds": 3, "tenant_requests": 80, "reloads": 10,
        "rolling": 2, "grid_requests": 32, "grid_rates": (2.0, 4.0, 8.0)}
QUICK = {"requests": 16, "rounds": 2, "rates": (0.5, 1.25), "latency_requests": 12, "overload_s": 8.0,
         "streams": 20, "router_requests": 24, "router_rounds": 1, "tenant_requests": 12, "reloads": 3,
         "rolling": 1, "grid_requests": 8, "grid_rates": (4.0,)}
OVERHEAD_TARGET = 0.85  # HTTP keeps at least 85% of the loop's throughput
HIT_RATE_TARGET = 1.5  # cache-aware's prefix hit rate over round robin's
TENANT_TARGET = 1.5  # the well-behaved tenant's p99 TTFT beside a flood, over alone
PAUSE_TARGET_S = 0.100  # a hot reload's pause
QUEUE = 64  # the overload section's server queue
POOL_TOKENS = 2800  # a router worker's KV pool: the running requests and about half the prefixes
PREFIXES = 10  # openings the router's shared-prefix prompts share (the validation files: all of them)
ROUTER_RATE = 6.0  # requests per second through the router
SERVE = ["--model", "target"]


def metrics_of(url: str) -> dict[str, float]:
    """The server's /metrics as {name{labels}: value}, the model_name label left out."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user and system) a process has used: this one, or `pid`."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def resident_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def summary(traces, duration_s: float) -> dict:
    return bench_metrics.compute(traces, duration_s)


# ---- overhead and latency -------------------------------------------------------------------------

class InProcessLoop:
    """The engine loop the server runs, with the server's engine settings (commands.add_serve's
    defaults), in this process: the peer that HTTP is measured against."""

    def __init__(self):
        from infra_lab.orchestration import served
        from infra_lab.serving.config import EngineConfig
        from infra_lab.serving.engine import Engine
        from infra_lab.serving.engine_loop import EngineLoop

        self.model = served.load("target")
        engine = Engine(self.model.model, EngineConfig(max_batch=32, token_budget=512, num_blocks=1024))
        self.loop = EngineLoop(engine, max_waiting=4096)

    def throughput(self, requests) -> float:
        """Output tokens/s of `requests` submitted all at once, each streamed by its handle."""
        from infra_lab.serving.request import SamplingParams

        started = time.perf_counter()
        handles = [self.loop.submit(self.model.encode(r.prompt), SamplingParams(temperature=0, max_tokens=r.max_tokens))
                   for r in requests]
        tokens = sum(len(h.result()) for h in handles)
        return tokens / (time.perf_counter() - started)


def overhead(sizes: dict) -> dict:
    requests = loadgen.workload("sharegpt", sizes["requests"], seed=1)
    loop_rates, http_rates, request_rates, ratios = [], [], [], []
    cpu = {"loop": [], "server": [], "client": []}  # CPU seconds per output token, each round
    tokens = sum(r.max_tokens for r in requests)
    peer = InProcessLoop()
    with launch.start("serve", SERVE + ["--max-queue", str(len(requests) + 1)]) as server:
        loadgen.run(server.url, "target", requests[:8])  # both warm: the kernels' first shapes compiled
        peer.throughput(requests[:8])
        pid = server.process.pid
        for round_ in range(sizes["rounds"]):
            order = ("loop", "http") if round_ % 2 == 0 else ("http", "loop")
            rates = {}
            for kind in order:
                mine, theirs = cpu_s(), cpu_s(pid)
                if kind == "loop":
                    rates[kind] = peer.throughput(requests)
                    cpu["loop"].append((cpu_s() - mine) / tokens)
                else:
                    traces, duration_s = loadgen.run(server.url, "target", requests)
                    cpu["client"].append((cpu_s() - mine) / tokens)
                    cpu["server"].append((cpu_s(pid) - theirs) / tokens)
                    figures = summary(traces, duration_s)
                    assert figures["failed"] == 0, [t.error for t in traces if not t.success][:3]
                    rates[kind] = figures["output_throughput"]
                    request_rates.append(figures["request_throughput"])
            loop_rates.append(rates["loop"])
            http_rates.append(rates["http"])
            ratios.append(rates["http"] / rates["loop"])
    peer.loop.shutdown()
    ratio = statistics.median(ratios)
    low, high = median_interval(ratios)
    return {"requests": len(requests), "output_tokens": sum(r.max_tokens for r in requests),
            "tokens_per_s": {"loop": statistics.median(loop_rates), "http": statistics.median(http_rates)},
            "saturating_request_rate": statistics.median(request_rates),
            "http_over_loop": {"median": ratio, "interval_95": [low, high], "rounds": ratios},
            "cpu_us_per_token": {k: 1e6 * statistics.median(v) for k, v in cpu.items()},
            "cores_busy": {"loop": statistics.median(loop_rates) * statistics.median(cpu["loop"]),
                           "server": statistics.median(http_rates) * statistics.median(cpu["server"]),
                           "client": statistics.median(http_rates) * statistics.median(cpu["client"])},
            "target": f"HTTP keeps at least {OVERHEAD_TARGET:.0%} of the loop", "passed": ratio >= OVERHEAD_TARGET}


def latency(sizes: dict, saturating_rate: float) -> dict:
    """The latency-throughput curve: Poisson arrivals at shares of the saturating rate."""
    requests = loadgen.workload("sharegpt", sizes["latency_requests"], seed=2)
    runs = {}
    with launch.start("serve", SERVE) as server:
        loadgen.run(server.url, "target", requests[:4])
        for rate in (round(share * saturating_rate, 2) for share in sizes["rates"]):
            traces, duration_s = loadgen.run(server.url, "target", requests, rate_per_s=rate, seed=3)
            figures = summary(traces, duration_s)
            done = [t for t in traces if t.success]
            runs[str(rate)] = figures | {"rate_per_s": rate,
                                         "ttft_s": [t.ttft_s for t in done],
                                         "tpot_s": [t.tpot_s for t in done if t.tpot_s is not None]}
    return {"requests": len(requests), "runs": runs, "passed": all(r["failed"] == 0 for r in runs.values())}


# ---- overload and disconnects -----------------------------------------------------------------------

def overload(sizes: dict, saturating_rate: float) -> dict:
    rate = 3 * saturating_rate
    n = max(1, int(rate * sizes["overload_s"]))
    requests = loadgen.workload("sharegpt", n, seed=4)
    with launch.start("serve", SERVE + ["--max-queue", str(QUEUE)]) as server:
        pid, memory_mb, done = server.process.pid, [], threading.Event()
        memory_mb.append(resident_mb(pid))

        def sample():
            while not done.wait(1.0):
                memory_mb.append(resident_mb(pid))

        sampler = threading.Thread(target=sample)
        sampler.start()
        traces, duration_s = loadgen.run(server.url, "target", requests, rate_per_s=rate, seed=5, timeout_s=300)
        done.set()
        sampler.join()
        after = metrics_of(server.url)
    statuses: dict[str, int] = {}
    for trace in traces:
        key = "tokens" if trace.success else (str(trace.status) if trace.status else "no answer")
        statuses[key] = statuses.get(key, 0) + 1
    ok = set(statuses) <= {"tokens", "429"}
    return {"rate_per_s": rate, "saturating_rate_per_s": saturating_rate, "seconds": sizes["overload_s"],
            "requests": n, "queue": QUEUE, "outcomes": statuses, "duration_s": duration_s,
            "resident_mb": {"start": memory_mb[0], "max": max(memory_mb), "end": memory_mb[-1]},
            "kv_blocks_used_after": after["infra_lab_kv_blocks_used{}"],
            "passed": ok and after["infra_lab_kv_blocks_used{}"] == 0}


async def _cut_streams(url: str, cuts: list[int]) -> None:
    body = {"model": "target", "prompt": "def main(argv):\n    ", "max_tokens": 300, "temperature": 0.8,
            "stream": True}
    slots = asyncio.Semaphore(10)
    async with httpx.AsyncClient(timeout=60) as client:
        async def one(cut: int) -> None:
            async with slots, client.stream("POST", url + "/v1/completions", json=body) as response:
                events = 0
                async for line in response.aiter_lines():
                    events += line.startswith("data: ")
                    if events >= cut:
                        break

        await asyncio.gather(*(one(c) for c in cuts))


def disconnects(sizes: dict) -> dict:
    cuts = [int(c) for c in np.random.default_rng(6).integers(1, 60, size=sizes["streams"])]
    with launch.start("serve", SERVE) as server:
        asyncio.run(_cut_streams(server.url, cuts))
        deadline, key = time.monotonic() + 30, "infra_lab_abort_delay_steps_count{}"
        while metrics_of(server.url)[key] < len(cuts) and time.monotonic() < deadline:
            time.sleep(0.1)
        after = metrics_of(server.url)
    buckets = {le: after[f"infra_lab_abort_delay_steps_bucket{{le={le}}}"] for le in ("0.0", "1.0", "2.0", "+Inf")}
    return {"streams": len(cuts), "aborted": after["infra_lab_abort_delay_steps_count{}"],
            "abort_delay_steps_at_most": buckets, "kv_blocks_used_after": after["infra_lab_kv_blocks_used{}"],
            "passed": buckets["1.0"] == len(cuts) and after["infra_lab_kv_blocks_used{}"] == 0}


# ---- hot reload -------------------------------------------------------------------------------------

def weight_files(folder: Path) -> list[tuple[str, str]]:
    """The target's weights and a variant (every matrix scaled by 0.9), as .npz files with their SHA-256."""
    from infra_lab.model import weights
    from infra_lab.orchestration.weights_file import sha256_of

    state, config, figures = weights.load(weights.path_for("target"))
    out = []
    for i, scale in enumerate((1.0, 0.9)):
        path = folder / f"weights_{i}.npz"
        weights.save({k: v * scale if v.ndim == 2 else v for k, v in state.items()}, config, path, figures)
        out.append((str(path), sha256_of(path)))
    return out


class SteadyLoad:
    """Streams of 16 greedy tokens, one after another from `senders` threads, until stopped: each
    response's fingerprints (the weight versions its chunks came from), or its error."""

    def __init__(self, url: str, senders: int = 2):
        self.url, self.outcomes, self.stopping = url, [], threading.Event()
        self.threads = [threading.Thread(target=self._send) for _ in range(senders)]
        for thread in self.threads:
            thread.start()

    def _send(self) -> None:
        body = {"model": "target", "prompt": "import os\n", "max_tokens": 16, "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as client:
            while not self.stopping.is_set():
                try:
                    with client.stream("POST", self.url + "/v1/completions", json=body) as response:
                        if response.status_code != 200:
                            self.outcomes.append(f"HTTP {response.status_code}")
                            continue
                        prints = {json.loads(line[6:])["system_fingerprint"] for line in response.iter_lines()
                                  if line.startswith("data: {")}
                        self.outcomes.append(prints)
                except httpx.HTTPError as error:
                    self.outcomes.append(repr(error))

    def stop(self) -> list:
        self.stopping.set()
        for thread in self.threads:
            thread.join()
        return self.outcomes


def in_place_reloads(sizes: dict, files) -> dict:
    with launch.start("serve", SERVE + ["--admin-key", "bench"]) as server:
        load = SteadyLoad(server.url)
        answers = []
        for i in range(sizes["reloads"]):
            path, sha = files[(i + 1) % 2]
            time.sleep(0.3)
            answer = httpx.post(server.url + "/admin/weights", json={"path": path, "sha256": sha},
                                headers={"authorization": "Bearer bench"}, timeout=60)
            answers.append(answer.json() if answer.status_code == 200 else {"error": answer.text})
        time.sleep(0.3)
        outcomes = load.stop()
    failed = [o for o in outcomes if not isinstance(o, set)]
    pauses = [a.get("pause_s", math.inf) for a in answers]
    low, high = median_interval(pauses)
    return {"reloads": len(answers), "responses": len(outcomes), "failed": len(failed),
            "pause_ms": {"median": 1000 * statistics.median(pauses), "interval_95": [1000 * low, 1000 * high],
                         "rounds": [1000 * p for p in pauses]},
            "max_pause_ms": 1000 * max(pauses),
            "total_ms": [1000 * a.get("total_s", math.inf) for a in answers],
            "hash_ms": [1000 * a.get("hash_s", math.inf) for a in answers],
            "read_ms": [1000 * a.get("read_s", math.inf) for a in answers],
            "mixed_version_responses": sum(len(o) > 1 for o in outcomes if isinstance(o, set)),
            "file_bytes": Path(files[0][0]).stat().st_size,
            "passed": not failed and max(pauses) < PAUSE_TARGET_S}


def rolling_updates(sizes: dict, files) -> dict:
    from infra_lab.orchestration import rolling

    worker = launch.start("serve", SERVE, threads=1)
    with launch.start("route", ["--worker", worker.url, "--policy", "round-robin", "--admin-key", "bench",
                                "--health-interval", "0.2"]) as router:
        load = SteadyLoad(router.url)
        phases = []
        for i in range(sizes["rolling"]):
            path = files[(i + 1) % 2][0]
            time.sleep(0.5)
            serve_args = ["--model", path, "--served-model-name", "target", "--weight-version", str(i + 1)]
            worker, timings = rolling.rolling_update(router.url, "bench", worker, serve_args, threads=1)
            phases.append(timings)
        time.sleep(0.5)
        outcomes = load.stop()
    worker.stop()
    failed = [o for o in outcomes if not isinstance(o, set)]
    versions = sorted(set().union(*(o for o in outcomes if isinstance(o, set))))
    return {"updates": len(phases), "phases_s": phases, "responses": len(outcomes), "failed": len(failed),
            "versions_seen": versions,
            "failures": failed[:5], "one_version_each": all(len(o) == 1 for o in outcomes if isinstance(o, set)),
            "passed": not failed and all(len(o) == 1 for o in outcomes if isinstance(o, set))
            and len(versions) == len(phases) + 1}


def reload(sizes: dict) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        files = weight_files(Path(folder))
        in_place = in_place_reloads(sizes, files)
        rolled = rolling_updates(sizes, files)
    return {"in_place": in_place, "rolling": rolled, "target_pause_ms": 1000 * PAUSE_TARGET_S,
            "passed": in_place["passed"] and rolled["passed"]}


# ---- the router --------------------------------------------------------------------------------------

class Fleet:
    """`workers` fresh servers (one thread each, the radix cache: every run starts with empty
    trees, and each pool holds POOL_TOKENS), started side by side and warmed up, and routers
    over them."""

    def __init__(self, workers: int = 2):
        radix = SERVE + ["--prefix-cache", "radix", "--block-size", "1", "--num-blocks", str(POOL_TOKENS)]
        started: list = [None] * workers
        warm_up = [loadgen.BenchRequest("warm up " * (i + 1), 16, 8 * (i + 1)) for i in range(8)]

        def start(i: int) -> None:
            started[i] = launch.start("serve", radix, threads=1)
            loadgen.run(started[i].url, "target", warm_up)  # the kernels' batch shapes compiled

        threads = [threading.Thread(target=start, args=(i,)) for i in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.workers = [w for w in started if w is not None]
        if len(self.workers) < workers:
            self.stop()
            raise RuntimeError("a worker did not start")

    def router(self, policy: str, extra: list[str] = ()) -> launch.Launched:
        args = ["--policy", policy, "--health-interval", "0.2", *extra]
        for worker in self.workers:
            args += ["--worker", worker.url]
        return launch.start("route", args)

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()


def routed_run(policy: str, requests, rate: float, seed: int) -> dict:
    """`requests` through a router with `policy` over a fresh fleet of two workers."""
    fleet = Fleet()
    try:
        with fleet.router(policy) as router:
            traces, duration_s = loadgen.run(router.url, "target", requests, rate_per_s=rate, seed=seed)
    finally:
        fleet.stop()
    return summary(traces, duration_s)


def router(sizes: dict, saturating_rate: float) -> dict:
    rate = ROUTER_RATE
    per_policy: dict[str, list[dict]] = {"round-robin": [], "least-outstanding": [], "cache-aware": []}
    for round_ in range(sizes["router_rounds"]):
        requests = loadgen.workload("shared-prefix", sizes["router_requests"], seed=round_,
                                    n_prefixes=PREFIXES)
        for policy in (list(per_policy) if round_ % 2 == 0 else list(per_policy)[::-1]):
            per_policy[policy].append(routed_run(policy, requests, rate, seed=round_))
    killed = kill_a_worker(sizes)
    hit = {p: statistics.median(r["prefix_hit_rate"] for r in runs) for p, runs in per_policy.items()}
    ttft = {p: statistics.median(r["mean_ttft_ms"] for r in runs) for p, runs in per_policy.items()}
    ratios = [c["prefix_hit_rate"] / r["prefix_hit_rate"] for c, r in zip(per_policy["cache-aware"],
                                                                          per_policy["round-robin"])]
    ratio = statistics.median(ratios)
    low, high = median_interval(ratios)
    return {"rate_per_s": rate, "pool_tokens": POOL_TOKENS, "prefixes": PREFIXES,
            "requests": sizes["router_requests"], "rounds": sizes["router_rounds"],
            "prefix_hit_rate": hit, "mean_ttft_ms": ttft,
            "runs": {p: [{k: r[k] for k in ("prefix_hit_rate", "mean_ttft_ms", "p99_ttft_ms", "failed",
                                            "request_throughput")} for r in runs] for p, runs in per_policy.items()},
            "hit_rate_cache_aware_over_round_robin": {"median": ratio, "interval_95": [low, high], "rounds": ratios},
            "kill": killed,
            "target": f"cache-aware >= {HIT_RATE_TARGET}x round robin's hit rate, lower mean TTFT",
            "passed": ratio >= HIT_RATE_TARGET and ttft["cache-aware"] < ttft["round-robin"] and killed["passed"]}


def kill_a_worker(sizes: dict) -> dict:
    """Two workers behind the router; one is killed (SIGKILL) 2 s into a run: every request that
    had not started streaming must succeed (retried on the other worker, or routed there)."""
    fleet = Fleet()
    try:
        with fleet.router("round-robin") as router:
            requests = loadgen.workload("sharegpt", sizes["router_requests"], seed=7)
            killer = threading.Timer(2.0, fleet.workers[0].kill)
            killer.start()
            traces, _ = loadgen.run(router.url, "target", requests, rate_per_s=4.0, seed=8)
            killer.join()
    finally:
        fleet.stop()
    failed = [t for t in traces if not t.success]
    before_streaming = [t for t in failed if not t.chunk_s]
    return {"requests": len(traces), "failed": len(failed), "failed_before_first_token": len(before_streaming),
            "failed_mid_stream": len(failed) - len(before_streaming), "passed": not before_streaming}


def tenants(sizes: dict, saturating_rate: float) -> dict:
    good_rate = saturating_rate / 4
    flood_quota = saturating_rate / 10  # requests per second the flooding tenant may send: it sends 10x
    config = {"tenants": [
        {"name": "good", "api_key": "good-key", "priority": 1, "requests_per_s": 10 * good_rate},
        {"name": "flood", "api_key": "flood-key", "priority": 0, "requests_per_s": flood_quota,
         "request_burst": 2}]}
    fleet = Fleet()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(config, handle)
    try:
        good = loadgen.workload("sharegpt", sizes["tenant_requests"], seed=9, max_tokens=64)
        lasting_s = len(good) / good_rate  # the flood lasts as long as the good tenant's run
        flood = loadgen.workload("sharegpt", max(1, round(10 * flood_quota * lasting_s)), seed=10, max_tokens=64)
        with fleet.router("least-outstanding", ["--tenants", handle.name]) as router:
            alone, _ = loadgen.run(router.url, "target", good, rate_per_s=good_rate, seed=11, api_key="good-key")
            both: dict = {}

            def flood_run():
                both["flood"] = loadgen.run(router.url, "target", flood, rate_per_s=10 * flood_quota, seed=12,
                                            api_key="flood-key")[0]

            flooder = threading.Thread(target=flood_run)
            flooder.start()
            beside, _ = loadgen.run(router.url, "target", good, rate_per_s=good_rate, seed=11, api_key="good-key")
            flooder.join()
    finally:
        fleet.stop()
        Path(handle.name).unlink()

    def p99_ms(traces):
        return float(np.percentile([t.ttft_s for t in traces if t.success], 99)) * 1000

    flood_statuses = [t.status for t in both["flood"]]
    ratio = p99_ms(beside) / p99_ms(alone)
    return {"good_rate_per_s": good_rate, "flood_quota_per_s": flood_quota, "flood_rate_per_s": 10 * flood_quota,
            "good_p99_ttft_ms": {"alone": p99_ms(alone), "beside_flood": p99_ms(beside)},
            "good_failed": sum(not t.success for t in alone + beside), "flood_sent": len(flood_statuses),
            "flood_429": flood_statuses.count(429), "flood_served": sum(t.success for t in both["flood"]),
            "beside_over_alone": ratio, "target": f"p99 TTFT beside the flood within {TENANT_TARGET}x of alone",
            "passed": ratio <= TENANT_TARGET and flood_statuses.count(429) > 0}


def explorer(sizes: dict) -> dict:
    """Policy x workload x rate through the router over two workers: hit rate, TTFT, TPOT."""
    grid = {}
    for workload in loadgen.WORKLOADS:
        for rate in sizes["grid_rates"]:
            requests = loadgen.workload(workload, sizes["grid_requests"], seed=int(rate * 10),
                                        n_prefixes=PREFIXES)
            for policy in ("round-robin", "least-outstanding", "cache-aware"):
                figures = routed_run(policy, requests, rate, seed=1)
                grid[f"{policy}|{workload}|{rate}"] = {k: figures[k] for k in (
                    "prefix_hit_rate", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "request_throughput", "failed")}
    return {"rates": list(sizes["grid_rates"]), "workloads": list(loadgen.WORKLOADS), "grid": grid,
            "passed": all(v["failed"] == 0 for v in grid.values())}


def headline(name: str, figures: dict) -> str:
    if name == "overhead":
        ratio, rates = figures["http_over_loop"], figures["tokens_per_s"]
        low, high = ratio["interval_95"]
        return (f"loop {rates['loop']:,.0f} tokens/s, HTTP {rates['http']:,.0f}; HTTP / loop "
                f"{ratio['median']:.3f} (95% {low:.3f}-{high:.3f}), {'met' if figures['passed'] else 'missed'}")
    if name == "latency":
        return "; ".join(f"{r['rate_per_s']:g}/s: TTFT p50 {r['median_ttft_ms']:.0f} ms, TPOT {r['mean_tpot_ms']:.1f} "
                         f"ms, ITL {r['mean_itl_ms']:.1f} ms" for r in figures["runs"].values())
    if name == "overload":
        return (f"{figures['rate_per_s']:.1f} req/s for {figures['seconds']:g} s: {figures['outcomes']}, memory "
                f"{figures['resident_mb']['start']:.0f}-{figures['resident_mb']['max']:.0f} MB, blocks after "
                f"{figures['kv_blocks_used_after']:.0f}")
    if name == "disconnects":
        return (f"{figures['aborted']:.0f} of {figures['streams']} aborted, within one step: "
                f"{figures['abort_delay_steps_at_most']['1.0']:.0f}; blocks after "
                f"{figures['kv_blocks_used_after']:.0f}")
    if name == "router":
        return (f"hit rate {figures['prefix_hit_rate']}, mean TTFT {figures['mean_ttft_ms']}; cache-aware / round "
                f"robin {figures['hit_rate_cache_aware_over_round_robin']['median']:.2f}x; kill: {figures['kill']}")
    if name == "tenants":
        return (f"good p99 TTFT {figures['good_p99_ttft_ms']}, ratio {figures['beside_over_alone']:.2f}; flood "
                f"{figures['flood_429']} 429s of {figures['flood_sent']}")
    if name == "reload":
        return (f"in place: max pause {figures['in_place']['max_pause_ms']:.2f} ms, failed "
                f"{figures['in_place']['failed']}; rolling: {figures['rolling']['updates']} updates, failed "
                f"{figures['rolling']['failed']}, one version each {figures['rolling']['one_version_each']}")
    return f"{len(figures['grid'])} runs"


def main() -> None:
    parser = section_parser(__doc__, SECTIONS, RESULTS)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL

    def saturating(sections: dict) -> float:
        if "overhead" in sections:
            return sections["overhead"]["saturating_request_rate"]
        if RESULTS.is_file():
            return json.loads(RESULTS.read_text())["sections"]["overhead"]["saturating_request_rate"]
        return 4.0

    run_sections("benchmarks/serving_http.py", SECTIONS,
                 {"overhead": lambda _: overhead(sizes), "latency": lambda s: latency(sizes, saturating(s)),
                  "overload": lambda s: overload(sizes, saturating(s)), "disconnects": lambda _: disconnects(sizes),
                  "router": lambda s: router(sizes, saturating(s)), "tenants": lambda s: tenants(sizes, saturating(s)),
                  "reload": lambda _: reload(sizes), "explorer": lambda _: explorer(sizes)},
                 args, headline, RESULTS, {"quick": args.quick, "sizes": sizes})


if __name__ == "__main__":
    main()
