"""A rolling update through the router: start a new worker (new weights, say), let it join, drain
the old one and stop it, so clients never see the fleet down (SGLang's router and Kubernetes
roll workers the same way: add before remove).

Each request is served by one worker start to finish: the router sends nothing new to a draining
worker and waits for what it has, so every response comes from exactly one weights version.
"""
from __future__ import annotations

import time

import httpx

from infra_lab.orchestration import launch


def _wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker {url} did not answer GET /health with 200 within {timeout_s} s")
        time.sleep(0.1)


def rolling_update(router_url: str, admin_key: str, old, serve_args: list[str], start_timeout_s: float = 120.0,
                   drain_timeout_s: float = 60.0, threads: int | None = None) -> tuple[launch.Launched, dict]:
    """Replace worker `old` (a `launch.Launched`) behind the router at `router_url` by a new
    `infra-lab serve SERVE_ARGS...`. Returns the new worker and the seconds each phase took:
    start_s, healthy_s, add_s, drain_s, stop_s and total_s. If the new worker cannot join, it is
    stopped and the old one keeps serving."""
    router_url = router_url.rstrip("/")
    admin = {"authorization": f"Bearer {admin_key}"}
    timings, began = {}, time.monotonic()

    def phase(name: str, since: float) -> float:
        now = time.monotonic()
        timings[name] = now - since
        return now

    new = launch.start("serve", serve_args, timeout_s=start_timeout_s, threads=threads)
    mark = phase("start_s", began)
    try:
        _wait_healthy(new.url, start_timeout_s)
        mark = phase("healthy_s", mark)
        added = httpx.post(f"{router_url}/admin/workers", json={"url": new.url}, headers=admin, timeout=30.0)
        if added.status_code != 201:
            raise RuntimeError(f"the router refused worker {new.url}: {added.status_code} {added.text}")
    except BaseException:
        new.stop()
        raise
    mark = phase("add_s", mark)
    removed = httpx.request("DELETE", f"{router_url}/admin/workers", headers=admin,
                            params={"url": old.url, "timeout_s": drain_timeout_s}, timeout=drain_timeout_s + 30.0)
    if removed.status_code != 200:
        raise RuntimeError(f"the router did not remove worker {old.url}: {removed.status_code} {removed.text}")
    mark = phase("drain_s", mark)
    old.stop()
    phase("stop_s", mark)
    timings["total_s"] = time.monotonic() - began
    return new, timings
