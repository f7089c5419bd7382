"""Tenants: who sent a request, how much they may send, and who goes first when the workers are
full. Each tenant has two token buckets, one on requests and one on tokens, as OpenAI's API limits
requests and tokens per minute; the router's priority admission follows SGLang's router, whose
requests wait in the router when every worker is busy.

A tenant is its API key (`Authorization: Bearer KEY`), else the body's `user` field, else
"anonymous". At admission a request is charged `max_tokens * n` plus its prompt's characters / 4:
OpenAI's rate limiter likewise estimates a request's tokens from max_tokens and the prompt's
characters before anything is generated, so the charge is known before the request runs.
"""
from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

DEFAULT_MAX_TOKENS = 16  # what a completion generates when it names no max_tokens (OpenAI's default)
CHARS_PER_TOKEN = 4  # OpenAI's rule of thumb for English text


class TokenBucket:
    """`rate_per_s` units refill per second, up to `burst`. `take(n)` takes n units if the bucket
    holds them and returns 0; otherwise it takes nothing and returns the seconds until it would.
    A cost above `burst` is charged as `burst`: it waits for a full bucket and empties it."""

    def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float] = time.monotonic):
        if not rate_per_s > 0 or not burst >= 1:
            raise ValueError(f"a bucket needs rate_per_s > 0 and burst >= 1; got {rate_per_s} and {burst}")
        self.rate_per_s, self.burst, self.clock = rate_per_s, burst, clock
        self.level = burst
        self.updated_s = clock()

    def _refill(self) -> None:
        now = self.clock()
        if math.isinf(self.rate_per_s):
            self.level = self.burst
        else:
            self.level = min(self.burst, self.level + (now - self.updated_s) * self.rate_per_s)
        self.updated_s = now

    def wait_s(self, cost: float) -> float:
        """Seconds until `cost` units are there (0: now). Takes nothing."""
        self._refill()
        missing = min(cost, self.burst) - self.level
        return 0.0 if missing <= 0 else missing / self.rate_per_s

    def take(self, cost: float) -> float:
        wait = self.wait_s(cost)
        if wait == 0:
            self.level -= min(cost, self.burst)
        return wait


@dataclass(frozen=True)
class TenantSpec:
    """One tenant's settings, as in the tenants file. Quotas are per second; inf is no limit, and
    a burst left out is one second's worth (at least 1)."""

    name: str = "default"
    api_key: str | None = None
    priority: int = 0  # higher goes first when requests wait for a worker
    requests_per_s: float = math.inf
    request_burst: float | None = None
    tokens_per_s: float = math.inf
    token_burst: float | None = None

    @classmethod
    def from_dict(cls, entry: dict, where: str) -> TenantSpec:
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be an object; got {entry!r}")
        allowed = {f.name for f in fields(cls)}
        unknown = set(entry) - allowed
        if unknown:
            raise ValueError(f"{where} has unknown fields {sorted(unknown)}; allowed: {sorted(allowed)}")
        spec = cls(**{k: (math.inf if v is None and k.endswith("_per_s") else v) for k, v in entry.items()})
        for name in ("requests_per_s", "tokens_per_s"):
            if not getattr(spec, name) > 0:
                raise ValueError(f"{where}.{name} must be > 0 (or null: no limit); got {getattr(spec, name)}")
        for name in ("request_burst", "token_burst"):
            value = getattr(spec, name)
            if value is not None and not value >= 1:
                raise ValueError(f"{where}.{name} must be >= 1; got {value}")
        return spec

    def buckets(self, clock: Callable[[], float]) -> tuple[TokenBucket, TokenBucket]:
        def burst(given, rate):
            return given if given is not None else max(1.0, rate)

        return (TokenBucket(self.requests_per_s, burst(self.request_burst, self.requests_per_s), clock),
                TokenBucket(self.tokens_per_s, burst(self.token_burst, self.tokens_per_s), clock))


def token_cost(body: dict, prompt_text: str) -> int:
    """The tokens charged at admission: max_tokens * n + the prompt's characters / 4, rounded up."""
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or DEFAULT_MAX_TOKENS
    n = body.get("n") or 1
    if not isinstance(max_tokens, int) or not isinstance(n, int):
        max_tokens, n = DEFAULT_MAX_TOKENS, 1  # the worker refuses such a body; charge as the default
    return max(0, max_tokens) * max(1, n) + math.ceil(len(prompt_text) / CHARS_PER_TOKEN)


class Tenants:
    """The tenants the router knows (by API key) and the default for everyone else; each distinct
    tenant has its own pair of buckets."""

    def __init__(self, specs: list[TenantSpec] = (), default: TenantSpec = TenantSpec(),
                 clock: Callable[[], float] = time.monotonic):
        self.by_key = {}
        for spec in specs:
            if not spec.api_key:
                raise ValueError(f"tenant {spec.name!r} needs an api_key: that is how its requests are known")
            if spec.api_key in self.by_key:
                raise ValueError(f"tenants {self.by_key[spec.api_key].name!r} and {spec.name!r} share an api_key")
            self.by_key[spec.api_key] = spec
        self.default, self.clock = default, clock
        self._buckets: dict[str, tuple[TokenBucket, TokenBucket]] = {}
        self._specs: dict[str, TenantSpec] = {spec.name: spec for spec in specs}

    @classmethod
    def from_json(cls, config: dict, clock: Callable[[], float] = time.monotonic) -> Tenants:
        """`{"tenants": [{"name", "api_key", "priority", "requests_per_s", ...}], "default": {...}}`"""
        if not isinstance(config, dict) or not set(config) <= {"tenants", "default"}:
            raise ValueError(f"a tenants file is an object with 'tenants' and 'default'; got {str(config)[:200]}")
        specs = [TenantSpec.from_dict(entry, f"tenants[{i}]") for i, entry in enumerate(config.get("tenants", []))]
        default = TenantSpec.from_dict({"name": "default", **config.get("default", {})}, "default")
        return cls(specs, default, clock)

    @classmethod
    def load(cls, path: str | Path, clock: Callable[[], float] = time.monotonic) -> Tenants:
        return cls.from_json(json.loads(Path(path).read_text()), clock)

    def identify(self, authorization: str | None, user: object = None) -> str:
        """The tenant's name: a known API key's tenant; an unknown key (as `key-` and a hash, so
        no key shows in the metrics); else `user-` and the body's user field; else anonymous."""
        if authorization and authorization.lower().startswith("bearer "):
            key = authorization[7:].strip()
            if key in self.by_key:
                return self.by_key[key].name
            if key:
                return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
        if isinstance(user, str) and user:
            return "user-" + user
        return "anonymous"

    def spec(self, tenant: str) -> TenantSpec:
        return self._specs.get(tenant, self.default)

    def priority(self, tenant: str) -> int:
        return self.spec(tenant).priority

    def admit(self, tenant: str, tokens: float) -> float:
        """Charge one request of `tokens` to `tenant`: 0 if admitted, else the seconds until both
        buckets hold enough (and nothing is charged)."""
        if tenant not in self._buckets:
            self._buckets[tenant] = self.spec(tenant).buckets(self.clock)
        requests, token_bucket = self._buckets[tenant]
        wait = max(requests.wait_s(1), token_bucket.wait_s(tokens))
        if wait == 0:
            requests.take(1)
            token_bucket.take(tokens)
        return wait


class PriorityGate:
    """Requests waiting for a worker slot: higher priority first, then arrival order.

    `free_slots()` counts the slots free now. `acquire` returns at once if nobody waits and a
    slot is free; otherwise it waits until `release` hands it one. Once `acquire` returns, the
    caller must take its slot before it next awaits. A cancelled waiter gives its turn on."""

    def __init__(self, free_slots: Callable[[], int]):
        self.free_slots = free_slots
        self._waiting: list = []  # (-priority, arrival, future)
        self._arrivals = itertools.count()
        self._granted = 0  # slots handed to waiters that have not taken them yet

    @property
    def waiting(self) -> int:
        return sum(1 for *_, future in self._waiting if not future.done())

    async def acquire(self, priority: int) -> None:
        if not self.waiting and self.free_slots() - self._granted > 0:
            return
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (-priority, next(self._arrivals), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted, then cancelled: pass it on
                self._granted -= 1
                self.release()
            raise
        self._granted -= 1

    def release(self) -> None:
        """A slot may have freed (a request ended, a worker joined): wake waiters while slots last."""
        while self._waiting and self.free_slots() - self._granted > 0:
            *_, future = heapq.heappop(self._waiting)
            if not future.done():
                future.set_result(None)
                self._granted += 1
