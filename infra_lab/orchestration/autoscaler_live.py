"""Autoscaling real workers (chapter 06): the simulator's autoscalers (serving.autoscaling) driving
`infra-lab serve` processes behind `infra-lab route`, on this machine.

Every `interval_s` the controller scrapes each worker's /metrics into a Snapshot (waiting and
running requests, KV blocks in use) and the router's for the requests that arrived since the
last scrape (per second), and asks the autoscaler how many replicas it wants. Scaling up starts
a worker (its cold start is the real one: a process, the model's weights, the kernels' first
compilation) and adds it to the router once it listens; scaling down drains the newest worker
through the router (it takes no new requests and finishes those it has) and then stops it. One
action per interval, as the autoscaler's limits say. Every action is logged with its time.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from infra_lab.orchestration import launch
from infra_lab.serving.autoscaling import Autoscaler, Snapshot


@dataclass
class Action:
    time_s: float  # since the controller started
    kind: str  # "start", "ready" (added to the router), "drain", "stopped"
    url: str


@dataclass
class Replica:
    starting: launch.Starting | None
    worker: launch.Launched | None = None
    asked_s: float = 0.0


@dataclass
class LiveAutoscaler:
    """Scale `infra-lab serve --model ...` workers behind the router at `router_url`."""
    router_url: str
    admin_key: str
    autoscaler: Autoscaler
    serve_args: list[str]
    workers: list[launch.Launched]  # those running at the start (already in the router)
    threads: int = 1
    actions: list[Action] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)

    def __post_init__(self):
        self.replicas = [Replica(None, w) for w in self.workers]
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread: threading.Thread | None = None
        self._received = (0.0, 0.0)  # (when, requests the router had received then)

    def now(self) -> float:
        return time.monotonic() - self._started

    def _admin(self, method: str, **kwargs) -> httpx.Response:
        return httpx.request(method, self.router_url + "/admin/workers", timeout=120,
                             headers={"authorization": f"Bearer {self.admin_key}"}, **kwargs)

    def snapshot(self) -> Snapshot:
        ready = [r.worker for r in self.replicas if r.worker is not None]
        waiting = running = used = total = 0.0
        for worker in ready:
            for family in text_string_to_metric_families(httpx.get(worker.url + "/metrics", timeout=30).text):
                for sample in family.samples:
                    if sample.name == "infra_lab_num_requests_waiting":
                        waiting += sample.value
                    elif sample.name == "infra_lab_num_requests_running":
                        running += sample.value
                    elif sample.name == "infra_lab_kv_blocks_used":
                        used += sample.value
                    elif sample.name == "infra_lab_kv_blocks_total":
                        total += sample.value
        starting = sum(1 for r in self.replicas if r.worker is None)
        received = sum(sample.value for family in text_string_to_metric_families(
            httpx.get(self.router_url + "/metrics", timeout=30).text) for sample in family.samples
            if sample.name == "router_tenant_requests_total")
        now = self.now()
        rate = (received - self._received[1]) / (now - self._received[0]) if now > self._received[0] else 0.0
        self._received = (now, received)
        return Snapshot(now, len(ready), starting, int(waiting), int(running),
                        min(1.0, used / total) if total else 0.0, arrivals_per_s=max(rate, 0.0))

    def tick(self) -> None:
        """Bring up replicas that finished starting; then one decision and at most one action."""
        for replica in list(self.replicas):
            if replica.worker is None and replica.starting.listening.is_set():
                try:
                    replica.worker = replica.starting.wait(1)
                except RuntimeError as error:  # it exited before it listened
                    self.replicas.remove(replica)
                    self.actions.append(Action(self.now(), "failed", str(error).splitlines()[0]))
                    continue
                self._admin("POST", json={"url": replica.worker.url}).raise_for_status()
                self.actions.append(Action(self.now(), "ready", replica.worker.url))
        snap = self.snapshot()
        self.snapshots.append(snap)
        wanted = self.autoscaler.decide(snap)
        if wanted > snap.requested:
            starting = launch.begin("serve", [*self.serve_args, "--threads", str(self.threads)], threads=self.threads)
            self.replicas.append(Replica(starting, None, self.now()))
            self.actions.append(Action(self.now(), "start", "(starting)"))
        elif wanted < snap.requested and snap.ready > 1:
            newest = next(r for r in reversed(self.replicas) if r.worker is not None)
            self.actions.append(Action(self.now(), "drain", newest.worker.url))
            self._admin("DELETE", params={"url": newest.worker.url})  # returns when its requests have ended
            newest.worker.stop()
            self.replicas.remove(newest)
            self.actions.append(Action(self.now(), "stopped", newest.worker.url))

    def start(self) -> None:
        def run():
            while not self._stop.wait(self.autoscaler.limits.interval_s):
                self.tick()

        self._thread = threading.Thread(target=run, daemon=True, name="live-autoscaler")
        self._thread.start()

    def stop(self) -> None:
        """Stop deciding; the replicas keep running (`replicas`), but any still starting is killed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(300)
        for replica in list(self.replicas):
            if replica.worker is None:
                replica.starting.launched.kill()
                self.replicas.remove(replica)
