"""Chapter 06, part 2: prefill/decode disaggregation on this machine, and at fleet scale in the
simulator. Sections:

- interference: long prompts arriving among 16 decoding requests, served by one engine on both
  cores without chunking, the same engine with chunked prefill, and a prefill process and a decode
  process with one core each (infra_lab.orchestration.interference), in turns over rounds: each
  run's p50 and p99 inter-token latency of the decoding requests, and its throughput. The target:
  the decode worker's p99 ITL at most 0.5x that of the colocated engine without chunking.
- transfer: K and V moved between two processes over gloo and over shared memory, as a share of
  a memory copy of the same bytes in one process (infra_lab.orchestration.transfer_speed).
- placement: DistServe's Figure 1 argument, its OSDI headline and Splitwise's, vLLM's
  throughput-versus-goodput remark, and the KV transfer bill, in the simulator.
- autoscaling: the 5x bursty trace replayed at fleet scale in the simulator (LLaMA-3-8B on H100s),
  as a time-lapse (TIME_LAPSE): SLO attainment against replica-seconds for each autoscaler, static
  peak and static mean.
- live_autoscaling: one worker behind the router with the simulator's target-tracking autoscaler
  on requests in flight, under a burst of streaming clients, then quiet: the actions (a second
  worker started, added, drained, stopped) and every request's outcome.
- explorer: goodput per GPU over model x GPU x SLO scale x prefill:decode ratio.

    python benchmarks/disaggregation.py [--quick] [--only SECTION] [--json PATH]
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as infra-lab serve runs: BLAS threads would spin

import statistics  # noqa: E402
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from engine_core import median_interval, run_sections, section_parser  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "disaggregation.json"
SECTIONS = ("interference", "transfer", "placement", "autoscaling", "live_autoscaling", "explorer")
FULL = {"rounds": 5, "decode_tokens": 200, "long_prompts": 8, "sizes": (2**20, 16 * 2**20, 128 * 2**20),
        "repeats": 5, "explorer": "small"}
QUICK = {"rounds": 1, "decode_tokens": 60, "long_prompts": 3, "sizes": (2**20,), "repeats": 2, "explorer": "quick"}
ITL_TARGET = 0.5  # the decode worker's p99 ITL over the colocated engine's without chunking
TIME_LAPSE = 0.1  # the autoscaling trace's phases, cold start, interval and windows at this share of their
# length (autoscaling_study.Scenario.time_scale): the GPU's step times and the SLO stay as they are


def interference(sizes: dict) -> dict:
    from infra_lab.orchestration import interference as runs

    mix = runs.Mix(decode_tokens=sizes["decode_tokens"], long_prompts=sizes["long_prompts"])
    by_name: dict[str, list[dict]] = {}
    books = None
    for round_ in range(sizes["rounds"]):  # in turns, so that drift on the machine hits all three
        for make in (lambda: runs.colocated(mix, chunked=False), lambda: runs.colocated(mix, chunked=True)):
            run = make()
            by_name.setdefault(run.name, []).append(run.summary())
        run, books = runs.disaggregated(mix)
        by_name.setdefault(run.name, []).append(run.summary())
    whole, pd = by_name["colocated, whole prompts"], by_name["disaggregated"]
    ratios = [d["itl_p99_ms"] / w["itl_p99_ms"] for d, w in zip(pd, whole)]
    low, high = median_interval(ratios)
    median = statistics.median(ratios)
    return {"mix": vars(mix), "runs": by_name, "p99_itl_pd_over_whole": {"median": median, "low": low, "high": high,
                                                                           "rounds": ratios},
            "target": ITL_TARGET, "passed": high <= ITL_TARGET, "books": books,
            "medians": {name: {key: statistics.median(r[key] for r in rows)
                               for key in ("itl_p50_ms", "itl_p99_ms", "tokens_per_s")}
                        for name, rows in by_name.items()}}


def transfer(sizes: dict) -> dict:
    from infra_lab.orchestration import transfer_speed

    return {"sizes": {str(size): figures for size, figures in
                      transfer_speed.measure(list(sizes["sizes"]), sizes["repeats"]).items()}}


def placement(sizes: dict) -> dict:
    """DistServe's Figure 1, vLLM's remark, the KV bill, and the two papers' headlines."""
    from infra_lab.orchestration import pd_claims, pd_headlines

    quick = sizes["explorer"] == "quick"
    bisection = pd_claims.Bisection(n=60, seeds=(0,), rel_tol=0.1, max_runs=6) if quick \
        else pd_claims.FIGURE1_BISECTION
    figure1 = pd_claims.figure1(bisection)
    out = {"figure1": figure1, "vllm": pd_claims.vllm_claim(n=60 if quick else 200, seeds=(0,) if quick else (0, 1, 2),
                                                             bisection=bisection),
           "kv_bill": pd_claims.kv_bill()}
    if not quick:
        out["distserve_headline"] = pd_headlines.distserve_headline()
        out["splitwise"] = {w: pd_headlines.splitwise_headline(w) for w in ("conversation", "coding")}
    return out


def autoscaling(sizes: dict) -> dict:
    """The 5x trace at fleet scale in the simulator: every autoscaler, static peak and static mean."""
    import numpy as np

    from infra_lab import roofline
    from infra_lab.serving import autoscaling_study as study

    quick = sizes["explorer"] == "quick"
    scenario = study.Scenario(roofline.LLAMA_3_8B, time_scale=0.013 if quick else TIME_LAPSE,
                              peak_load=4.2 if quick else 7.2)
    found = study.compare(scenario)
    table = found.table()
    window_s = 30.0 * scenario.time_scale if not quick else 0.5
    series = {name: {k: [None if not np.isfinite(v) else float(v) for v in values]
                     for k, values in run.series(window_s).items()} for name, run in found.runs.items()}
    best = max((n for n in table if not n.startswith("static")),
               key=lambda n: (table[n]["attainment"] >= scenario.slo.goal, -table[n]["over_static_peak"]))
    return {"scenario": {"model": scenario.model.name, "device": scenario.device.name, "swing": scenario.swing,
                         "peak_load": scenario.peak_load, "ttft_slo_s": scenario.slo.ttft_s,
                         "tpot_slo_s": scenario.slo.tpot_s, "goal": scenario.slo.goal,
                         "cold_start_s": scenario.cold_start_s, "interval_s": scenario.interval,
                         "time_scale": scenario.time_scale},
            "saturated_req_s": found.saturated_req_s, "targets": found.targets, "table": table,
            "headroom": found.headroom, "series": series, "window_s": window_s, "best": best,
            "target": {"attainment": 0.95, "over_static_peak": 0.70}}


def live_autoscaling(sizes: dict) -> dict:
    """Real processes: one worker behind the router, the simulator's target-tracking autoscaler on
    requests in flight, a burst of streaming clients, then quiet: a second worker starts, takes
    traffic, and is drained and stopped; every request's outcome is counted."""
    import threading
    import time

    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from infra_lab.orchestration import launch
    from infra_lab.orchestration.autoscaler_live import LiveAutoscaler
    from infra_lab.serving.autoscaling import Limits, TargetTracking

    serve = ["--model", "target", "--max-batch", "4"]
    first = launch.start("serve", serve + ["--threads", "1"], threads=1)
    router = launch.start("route", ["--worker", first.url, "--admin-key", "bench", "--policy", "least-outstanding"])
    scaler = TargetTracking("concurrency", 3.0, Limits(1, 2, interval_s=0.5), stabilization_s=3.0)
    live = LiveAutoscaler(router.url, "bench", scaler, serve, [first])
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    outcomes, stop, began = [], threading.Event(), time.monotonic()

    def load():
        while not stop.is_set():
            try:
                chunks = list(client.completions.create(model="target", prompt="def ", max_tokens=40, temperature=0,
                                                        stream=True))
                outcomes.append((time.monotonic() - began, chunks[-1].choices[0].finish_reason))
            except openai.APIError as error:
                outcomes.append((time.monotonic() - began, f"error: {error}"))

    senders = [threading.Thread(target=load) for _ in range(8)]
    live.start()
    for sender in senders:
        sender.start()
    time.sleep(20.0 if sizes["explorer"] != "quick" else 8.0)
    stop.set()
    for sender in senders:
        sender.join(120)
    deadline = time.monotonic() + 60
    while not any(a.kind == "stopped" for a in live.actions) and time.monotonic() < deadline:
        time.sleep(0.25)
    text = httpx.get(router.url + "/metrics", timeout=30).text
    routed = {s.labels["worker"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "router_worker_requests_total"}
    live.stop()
    for replica in live.replicas:
        replica.worker.stop()
    router.stop()
    return {"actions": [vars(a) for a in live.actions], "requests": len(outcomes),
            "failed": sum(1 for _, o in outcomes if o != "length"), "routed": routed,
            "snapshots": [{"time_s": s.time_s, "ready": s.ready, "starting": s.starting, "waiting": s.waiting,
                           "running": s.running} for s in live.snapshots]}


def explorer(sizes: dict) -> dict:
    from infra_lab.orchestration import pd_explorer

    return pd_explorer.explorer_grid("tiny" if sizes["explorer"] == "quick" else "small", progress=False)


def headline(name: str, figures: dict) -> str:
    if name == "interference":
        ratio = figures["p99_itl_pd_over_whole"]
        medians = "; ".join(f"{n}: p99 {m['itl_p99_ms']:.1f} ms, {m['tokens_per_s']:.0f} tok/s"
                            for n, m in figures["medians"].items())
        return f"{medians}; PD / whole p99 {ratio['median']:.2f} ({ratio['low']:.2f}-{ratio['high']:.2f})"
    if name == "transfer":
        return "; ".join(f"{int(size) / 2**20:g} MiB: gloo {f['gloo_share']:.1%}, shm {f['shm_share']:.1%} of memcpy"
                         for size, f in figures["sizes"].items())
    if name == "placement":
        rows = {r["figure"]: r["simulator"] for r in figures["figure1"]["rows"]}
        ratio = next(v for k, v in rows.items() if k.startswith("disaggregated / colocated"))
        return f"Figure 1: disaggregated / colocated per GPU {ratio:.2f}x (DistServe 2.1x)"
    if name == "autoscaling":
        best = figures["table"][figures["best"]]
        return (f"{figures['best']}: {best['attainment']:.1%} within SLO on {best['over_static_peak']:.0%} of static "
                f"peak's replica-seconds; static mean {figures['table']['static-mean']['attainment']:.1%}")
    if name == "live_autoscaling":
        return f"{[a['kind'] for a in figures['actions']]}, {figures['requests']} requests, {figures['failed']} failed"
    return f"{len(figures['rows'])} settings"


def main() -> None:
    parser = section_parser(__doc__, SECTIONS, RESULTS)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.rounds:
        sizes = sizes | {"rounds": args.rounds}
    run_sections("benchmarks/disaggregation.py", SECTIONS,
                 {"interference": lambda _: interference(sizes), "transfer": lambda _: transfer(sizes),
                  "placement": lambda _: placement(sizes), "autoscaling": lambda _: autoscaling(sizes),
                  "live_autoscaling": lambda _: live_autoscaling(sizes),
                  "explorer": lambda _: explorer(sizes)},
                 args, headline, RESULTS, {"quick": args.quick, "sizes": sizes})


if __name__ == "__main__":
    main()
