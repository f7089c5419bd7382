"""The simulator's autoscaler driving real workers: under load a second `infra-lab serve` starts,
joins the router and takes traffic; when the load stops it is drained and stopped, and no request
fails on the way."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infra_lab.orchestration import launch
from infra_lab.orchestration.autoscaler_live import LiveAutoscaler
from infra_lab.serving.autoscaling import Limits, TargetTracking

pytestmark = pytest.mark.slow
KEY = "scale"


def routed_requests(router_url: str) -> dict[str, float]:
    text = httpx.get(router_url + "/metrics", timeout=30).text
    return {s.labels["worker"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "router_worker_requests_total"}


def until(condition, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.25)
    return condition()


def test_a_second_worker_starts_takes_traffic_and_is_drained_with_no_failed_request():
    serve = ["--model", "target", "--max-batch", "4"]
    first = launch.start("serve", serve + ["--threads", "1"], threads=1)
    router = launch.start("route", ["--worker", first.url, "--admin-key", KEY, "--policy", "least-outstanding"])
    scaler = TargetTracking("concurrency", 3.0, Limits(1, 2, interval_s=0.5), stabilization_s=2.0)
    live = LiveAutoscaler(router.url, KEY, scaler, serve, [first])
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    outcomes, stop = [], threading.Event()

    def load():
        while not stop.is_set():
            try:
                chunks = list(client.completions.create(model="target", prompt="def ", max_tokens=40,
                                                        temperature=0, stream=True))
                outcomes.append(chunks[-1].choices[0].finish_reason)
            except openai.APIError as error:
                outcomes.append(error)

    senders = [threading.Thread(target=load) for _ in range(8)]
    try:
        live.start()
        for sender in senders:
            sender.start()
        assert until(lambda: any(a.kind == "ready" for a in live.actions)), live.actions
        second = next(a.url for a in live.actions if a.kind == "ready")
        assert until(lambda: routed_requests(router.url).get(second, 0) >= 5), "the new worker takes traffic"
        stop.set()
        for sender in senders:
            sender.join(120)
        assert until(lambda: any(a.kind == "stopped" for a in live.actions)), live.actions
    finally:
        stop.set()
        live.stop()
        for replica in live.replicas:
            replica.worker.stop()
        router.stop()
    kinds = [a.kind for a in live.actions]
    assert kinds[:2] == ["start", "ready"] and "drain" in kinds and "stopped" in kinds, live.actions
    assert outcomes and all(o == "length" for o in outcomes), \
        [o for o in outcomes if o != "length"][:3]
    assert len(live.replicas) == 1 and live.replicas[0].worker is first
