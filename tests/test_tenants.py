"""Token buckets, tenants and the priority gate, on a clock the test moves."""
import asyncio
import json
import math

import pytest

from infra_lab.orchestration.tenants import PriorityGate, TenantSpec, Tenants, TokenBucket, token_cost


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_bucket_refills_at_its_rate_up_to_its_burst():
    clock = Clock()
    bucket = TokenBucket(rate_per_s=2, burst=3, clock=clock)
    assert [bucket.take(1) for _ in range(3)] == [0, 0, 0]
    assert bucket.take(1) == pytest.approx(0.5)  # one unit missing at 2 per second
    assert bucket.take(2) == pytest.approx(1.0)
    clock.now += 0.5
    assert bucket.take(1) == 0
    clock.now += 100
    assert bucket.level == 0 and bucket.take(3) == 0 and bucket.take(1) == pytest.approx(0.5)


def test_a_refused_take_charges_nothing_and_a_cost_above_the_burst_waits_for_a_full_bucket():
    clock = Clock()
    bucket = TokenBucket(rate_per_s=10, burst=20, clock=clock)
    assert bucket.take(15) == 0
    assert bucket.take(50) == pytest.approx(1.5)  # charged as the burst, 20: 15 missing
    assert bucket.level == 5
    clock.now += 1.5
    assert bucket.take(50) == 0 and bucket.level == 0
    with pytest.raises(ValueError, match="rate_per_s > 0 and burst >= 1; got 0 and 5"):
        TokenBucket(0, 5)


def test_tenants_are_known_by_key_then_user_then_anonymous():
    tenants = Tenants([TenantSpec("acme", api_key="sk-acme", priority=2)])
    assert tenants.identify("Bearer sk-acme", user="bob") == "acme"
    assert tenants.identify(None, user="bob") == "user-bob"
    assert tenants.identify(None) == "anonymous"
    unknown = tenants.identify("Bearer sk-secret")
    assert unknown.startswith("key-") and "secret" not in unknown
    assert tenants.priority("acme") == 2 and tenants.priority("user-bob") == 0


def test_the_token_charge_is_max_tokens_times_n_plus_a_quarter_of_the_characters():
    assert token_cost({"max_tokens": 10, "n": 3}, "x" * 41) == 30 + 11
    assert token_cost({}, "") == 16
    assert token_cost({"max_completion_tokens": 5}, "abcd") == 6


def test_each_tenant_has_its_own_buckets_and_over_quota_gets_the_wait():
    clock = Clock()
    config = {"tenants": [{"name": "small", "api_key": "k1", "requests_per_s": 1, "request_burst": 2},
                          {"name": "tokens", "api_key": "k2", "tokens_per_s": 100, "token_burst": 100}],
              "default": {"requests_per_s": 0.5}}
    tenants = Tenants.from_json(config, clock)
    assert [tenants.admit("small", 10) for _ in range(3)] == [0, 0, pytest.approx(1.0)]
    assert tenants.admit("tokens", 80) == 0
    assert tenants.admit("tokens", 40) == pytest.approx(0.2)
    assert tenants.admit("tokens", 20) == 0, "the refused request charged nothing"
    assert tenants.admit("anonymous", 1) == 0 and tenants.admit("anonymous", 1) == pytest.approx(2.0)
    assert tenants.admit("user-x", 1) == 0, "another default tenant has buckets of its own"


def test_a_bad_tenants_file_names_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"tenants\[0\] has unknown fields \['rpm'\]"):
        Tenants.from_json({"tenants": [{"name": "a", "api_key": "k", "rpm": 3}]})
    with pytest.raises(ValueError, match=r"tenants\[0\].requests_per_s must be > 0"):
        Tenants.from_json({"tenants": [{"name": "a", "api_key": "k", "requests_per_s": 0}]})
    with pytest.raises(ValueError, match="share an api_key"):
        Tenants.from_json({"tenants": [{"name": "a", "api_key": "k"}, {"name": "b", "api_key": "k"}]})
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [{"name": "a", "api_key": "k", "requests_per_s": None}]}))
    assert Tenants.load(path).spec("a").requests_per_s == math.inf


def test_the_gate_admits_higher_priority_first_then_by_arrival():
    async def scenario():
        free = [0]
        gate = PriorityGate(lambda: free[0])
        order = []

        async def request(name, priority):
            await gate.acquire(priority)
            free[0] -= 1  # takes its slot before it next awaits
            order.append(name)

        tasks = []
        for name, priority in [("low-1", 0), ("high-1", 5), ("low-2", 0), ("high-2", 5), ("mid", 1)]:
            tasks.append(asyncio.create_task(request(name, priority)))
            await asyncio.sleep(0)
        cancelled = asyncio.create_task(request("gone", 9))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        assert gate.waiting == 5
        for _ in range(5):
            free[0] += 1
            gate.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["high-1", "high-2", "mid", "low-1", "low-2"]
