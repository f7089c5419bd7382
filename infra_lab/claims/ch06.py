"""Chapter 06, serving at scale: the chapter's verdicts on its server, router, reload, disaggregation and
autoscaling, and DistServe's, Splitwise's and SGLang's headlines beside the simulator and the router."""
from __future__ import annotations

from infra_lab import verdict
from infra_lab.claims.entry import Entry, Figure, committed, judged, section_of

SGLANG_V04 = "https://lmsys.org/blog/2024-12-04-sglang-v0-4/"
DISTSERVE = "Zhong et al., OSDI 2024"
SERVER = verdict.Claim(
    "HTTP streaming keeps at least 85% of the engine loop's own throughput at "
    "saturation (the same requests and engine settings, every token streamed)",
    "this book's target for its server", 0.85, "at least", unit="×", digits=3)
ROUTER = verdict.Claim(
    "cache-aware routing gets at least 1.5× round robin's prefix hit rate on the "
    "shared-prefix workload, two workers",
    "this book's target, after SGLang's router (3.8× the hit rate in its release)", 1.5, "at least")
TENANTS = verdict.Claim(
    "a well-behaved tenant's p99 TTFT, beside a tenant sending 10× its quota, stays "
    "within 1.5× of its p99 TTFT alone", "this book's target for its router", 1.5, "at most")
RELOAD = verdict.Claim("hot model reload interrupts serving for under 100 ms", "A", 100.0, "at most",
                       unit=" ms", digits=3)
INTERFERENCE = verdict.Claim(
    "a decode worker of its own cuts the p99 gap between tokens to at most half of one "
    "engine's without chunking, when long prompts arrive among running decodes",
    "this book's target, after DistServe's argument that the phases interfere", 0.5, "at most")
FIGURE_1 = verdict.Claim(
    "two prefill GPUs and one decode GPU serve at least twice the goodput per GPU of one GPU doing both, "
    "at DistServe's Figure 1 settings", "this book's target, after DistServe's Figure 1 (2.1×)", 2.0,
    "at least")


def autoscaling_claim(target: dict) -> verdict.Claim:
    """Chapter 06's claim, its figures from the committed run's target."""
    return verdict.Claim(
        "autoscaling copes with 5× swings in requests per second (here: at least "
        f"{target['attainment']:.0%} of requests within the objectives, on at most "
        f"{target['over_static_peak']:.0%} of the replica-seconds of provisioning for the peak)",
        "A", target["over_static_peak"], "at most", unit="", digits=2)


def http(claim: verdict.Claim, section: str, key: str, one_run: bool = False, note: str = ""):
    def figure() -> Figure | None:
        found = section_of("serving_http", section)
        if found is None:
            return None
        results, figures = found
        for part in key.split("/"):
            figures = figures[part]
        found = (verdict.one_run(results, figures, section) if one_run else
                 verdict.evidence(results, figures, section))
        return judged(claim, found, note)
    return figure


def interference() -> Figure | None:
    found = section_of("disaggregation", "interference")
    return found and judged(INTERFERENCE, verdict.evidence(found[0], found[1]["p99_itl_pd_over_whole"],
                                                           "interference"))


def figure_1() -> Figure | None:
    found = section_of("disaggregation", "placement")
    if found is None:
        return None
    split = next(row for row in found[1]["figure1"]["rows"]
                 if row["figure"].startswith("disaggregated / colocated"))
    return judged(FIGURE_1, verdict.one_run(found[0], split["simulator"], "placement"))


def autoscaling() -> Figure | None:
    found = section_of("disaggregation", "autoscaling")
    if found is None:
        return None
    scaled = found[1]
    best = scaled["table"][scaled["best"]]
    evidence = verdict.one_run(found[0], best["over_static_peak"], "autoscaling")
    return judged(autoscaling_claim(scaled["target"]), evidence,
                  f"the replica-seconds of {scaled['best']}, the best autoscaler, over provisioning for the peak, "
                  f"with {best['attainment']:.1%} of requests within the objectives (a simulated 5× swing)")


def reload_times() -> Figure | None:
    found = section_of("serving_http", "reload")
    if found is None:
        return None
    place = found[1]["in_place"]
    whole = sorted(place["total_ms"])[len(place["total_ms"]) // 2]
    return committed(found[0], "reload", f"serving paused {place['pause_ms']['median']:.3f} ms for an in-place swap; "
                     f"the whole reload of a {place['file_bytes'] / 1e6:.1f} MB file took {whole:.0f} ms (median of "
                     f"{place['reloads']}), while the engine kept serving")


def router_ratio() -> Figure | None:
    found = section_of("serving_http", "router")
    if found is None:
        return None
    ratio = found[1]["hit_rate_cache_aware_over_round_robin"]
    return committed(found[0], "router", f"{ratio['median']:.2f}× round robin's hit rate (median of "
                     f"{len(ratio['rounds'])} rounds; two workers on one CPU, short prompts)")


def distserve_headline() -> Figure | None:
    found = section_of("disaggregation", "placement")
    if found is None or not found[1].get("distserve_headline"):
        return None
    head = found[1]["distserve_headline"]
    return committed(found[0], "placement", f"{head['more_requests']:.2f}× the requests per GPU and a "
                     f"{head['tighter_slo']:.2f}× tighter objective, simulated at its chatbot setting "
                     f"({head['settings']['model']}, {head['settings']['budget_gpus']} A100s)")


def splitwise() -> Figure | None:
    found = section_of("disaggregation", "placement")
    if found is None or not found[1].get("splitwise"):
        return None
    split = found[1]["splitwise"]
    best = {trace: max(v for k, v in split[trace]["throughput_per_cost_vs_h100"].items()
                       if k.startswith("Splitwise")) for trace in ("conversation", "coding")}
    return committed(found[0], "placement", f"{best['conversation']:.2f}× an all-H100 fleet's throughput per "
                     f"dollar on its conversation trace, {best['coding']:.2f}× on its coding trace (simulated)")


def kv_bill() -> Figure | None:
    found = section_of("disaggregation", "placement")
    if found is None:
        return None
    bill = found[1]["kv_bill"]
    return committed(found[0], "placement", f"{bill['bytes']:,.0f} bytes: {bill['gib']:.3f} GiB (the paper's "
                     "\"GB\" is binary)")


def phases_fight() -> Figure | None:
    found = section_of("disaggregation", "interference")
    if found is None:
        return None
    ratio = found[1]["p99_itl_pd_over_whole"]
    return committed(found[0], "interference", f"a decode worker of its own cut the p99 gap between tokens to "
                     f"{ratio['median']:.2f}× one engine's (median of {len(ratio['rounds'])} rounds, two cores)")


ENTRIES = [
    Entry("06.server", "06", SERVER.statement, SERVER.source, "0.85× (a target)",
          http(SERVER, "overhead", "http_over_loop")),
    Entry("06.router", "06", ROUTER.statement, ROUTER.source, "1.5× (a target)",
          http(ROUTER, "router", "hit_rate_cache_aware_over_round_robin")),
    Entry("06.tenants", "06", TENANTS.statement, TENANTS.source, "1.5× (a target)",
          http(TENANTS, "tenants", "beside_over_alone", one_run=True)),
    Entry("06.hot-reload", "06", RELOAD.statement, "A", "under 100 ms",
          http(RELOAD, "reload", "in_place/pause_ms", note="the engine's pause for an in-place swap")),
    Entry("06.interference", "06", INTERFERENCE.statement, INTERFERENCE.source, "0.5× (a target)", interference),
    Entry("06.distserve-figure-1", "06", FIGURE_1.statement, f"{DISTSERVE}, Figure 1", "2.1×", figure_1),
    Entry("06.autoscaling-5x", "06", "autoscaling copes with 5× swings in requests per second", "A", "5× swings",
          autoscaling),
    Entry("06.prefill-decode-fight", "06",
          "prefill is compute-bound and decode bandwidth-bound; run together they slow each other, and "
          "prefill/decode disaggregation removes the wait", "A", "no figure given", phases_fight),
    Entry("06.sglang-router", "06",
          "SGLang's cache-aware load balancer gives up to 1.9× the throughput of round robin and 3.8× the cache "
          "hit rate, with several data-parallel workers on GPUs", "SGLang v0.4 release (LMSYS blog, December 2024)",
          "1.9× throughput, 3.8× hit rate", router_ratio, links=(SGLANG_V04,)),
    Entry("06.distserve-7.4x", "06",
          "DistServe serves up to 7.4× more requests, or meets a 12.6× tighter objective, than vLLM at 90% "
          "attainment", f"{DISTSERVE}, abstract", "7.4× more requests; 12.6× tighter", distserve_headline),
    Entry("06.splitwise", "06",
          "Splitwise gives 1.4× the throughput at 20% lower cost (1.75× the throughput per dollar), with prompt "
          "machines of H100s and token machines of A100s", "Patel et al., ISCA 2024",
          "1.4× at 20% lower cost", splitwise),
    Entry("06.vllm-sleep-mode", "06",
          "vLLM's sleep mode frees a model's GPU memory and brings it back in a fraction of a second to a few "
          "seconds, where reloading a model takes 30 to over 100 s",
          "vLLM blog, Zero-Reload Model Switching with vLLM Sleep Mode, October 2025", "30 to over 100 s",
          reload_times),
    Entry("06.distserve-kv-bill", "06", "one 512-token request of OPT-66B carries about 1.13 GB of K and V",
          DISTSERVE, "1.13 GB", kv_bill),
]
