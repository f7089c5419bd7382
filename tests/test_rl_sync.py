"""rl.sync, the weight-sync ladder: every rung leaves the engine serving exactly the trainer's weights
(array_equal on every name, and the greedy tokens of a fresh engine built on them); the buckets are
laid out once and never leak into the engine; bad weights, versions, layouts and engines are refused
by name with the engine unchanged; the two cross-process rungs deliver the bytes between spawned gloo
ranks, and a bad layout on one side fails on both without hanging. Timings are measured by
sync.measure_ladder, not asserted."""
import multiprocessing
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

from infra_lab.model import transformer
from infra_lab.model.config import ModelConfig, weight_shapes
from infra_lab.model.torch_model import TorchTransformer
from infra_lab.model.transformer import Transformer
from infra_lab.processes import run_on_ranks
from infra_lab.rl import sync
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import SamplingParams

PROMPTS = [list(b"def "), list(b"for i in"), list(b"import ")]
GREEDY = SamplingParams(max_tokens=8)
TINY = ModelConfig("tiny", n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32)  # byte vocabulary
TIMEOUT_S = 120.0  # only for a failure: a loaded machine can take tens of seconds to compile a rank's kernels


@pytest.fixture(scope="module")
def shipped() -> Transformer:
    return transformer.load("target")


def engine_on(config, state: dict) -> Engine:
    return Engine(Transformer(config, {name: np.array(value, np.float32) for name, value in state.items()}))


def train_step(trainer: TorchTransformer, seed: int) -> dict:
    """A stand-in for an optimizer step (every weight moves); the trainer's weights after it, copied."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 1e-2)
    return {name: value.copy() for name, value in trainer.numpy_weights().items()}


def weights_of(engine: Engine) -> dict:
    return {name: np.array(value) for name, value in engine.model.w.items()}


def same(got: dict, expected: dict) -> bool:
    return got.keys() == expected.keys() and all(np.array_equal(got[n], expected[n]) for n in expected)


def assert_serves(engine: Engine, expected: dict, version: int, generate: bool = True) -> None:
    assert engine.weight_version == version
    assert same(weights_of(engine), expected)
    if generate:
        assert engine.generate(PROMPTS, GREEDY) == engine_on(engine.model.config, expected).generate(PROMPTS, GREEDY)


# ---- the layout ----------------------------------------------------------------------------------

def test_the_layout_packs_every_weight_once_into_buckets_of_the_size_asked(shipped):
    layout, shapes = sync.plan(shipped.config, 1 << 20), weight_shapes(shipped.config)
    assert layout.shapes == shapes and layout.model == "target"
    assert layout.nbytes == 4 * shipped.n_params == 4_198_912 and len(layout.sizes) == 5
    for bucket, size in enumerate(layout.sizes):
        inside = [s for s in layout.slots if s.bucket == bucket]
        assert size <= (1 << 20) // 4 or len(inside) == 1  # a weight larger than a bucket gets its own
    alone = sync.plan(shipped.config, 64)  # every weight is larger than 64 bytes
    assert len(alone.sizes) == len(shapes) and all(s.offset == 0 for s in alone.slots)
    state = shipped.w
    buckets = [np.empty(n, np.float32) for n in layout.sizes]
    sync.pack(layout, state, buckets)
    out = sync.unpack(layout, buckets)
    for bucket in buckets:
        bucket[:] = np.nan  # unpack made a private copy
    assert same(out, {name: np.asarray(value) for name, value in state.items()})


def test_a_bad_layout_is_refused_by_name():
    with pytest.raises(ValueError, match="a and b overlap in bucket 0"):
        sync.Layout("m", (sync.Slot("a", 0, 0, (4,)), sync.Slot("b", 0, 2, (4,))))
    with pytest.raises(ValueError, match="a appears twice"):
        sync.Layout("m", (sync.Slot("a", 0, 0, (4,)), sync.Slot("a", 1, 0, (4,))))
    with pytest.raises(ValueError, match="a has a negative"):
        sync.Layout("m", (sync.Slot("a", 0, -1, (4,)),))
    with pytest.raises(ValueError, match="bucket_bytes"):
        sync.plan(TINY, 0)
    assert sync.plan(TINY, 4096).fingerprint != sync.plan(TINY, 8192).fingerprint


# ---- rungs 1 and 2, and 3 within one process --------------------------------------------------------

@pytest.mark.parametrize("rung", [sync.StateCopy, sync.Bucketed])
def test_the_in_process_rungs_serve_exactly_the_trainers_weights(shipped, rung):
    trainer, engine = TorchTransformer(shipped.config, shipped.w), engine_on(shipped.config, shipped.w)
    channel = rung(sync.plan(shipped.config))
    for version in (1, 2):
        expected = train_step(trainer, version)
        sent = channel.send(trainer, version)
        assert engine.weight_version == version - 1  # nothing changes before apply
        applied = channel.apply(engine)
        assert sent.version == applied.version == version and sent.nbytes == applied.nbytes == 4_198_912
        assert sent.seconds > 0 and applied.seconds > 0
        assert_serves(engine, expected, version, generate=version == 2)
    train_step(trainer, 3)
    channel.send(trainer, 3)  # rewrites the buckets: the engine, still on version 2, must not see it
    assert_serves(engine, expected, 2, generate=False)
    state, version = channel.receive()  # without an engine: the weights alone
    assert version == 3 and same(state, trainer.numpy_weights())


def test_the_shared_memory_rung_serves_the_trainers_weights_and_unlinks_its_segment(shipped):
    trainer, engine = TorchTransformer(shipped.config, shipped.w), engine_on(shipped.config, shipped.w)
    mine, theirs = multiprocessing.Pipe()
    layout = sync.plan(shipped.config)
    sender, receiver = sync.SharedMemorySender(layout, mine, TIMEOUT_S), sync.SharedMemoryReceiver(layout, theirs)
    name = sender.segment.name
    for version in (1, 2):  # one process plays both sides: the Pipe holds the message until read
        expected = train_step(trainer, version)
        sender.send(trainer, version)
        receiver.apply(engine)
        sender.wait()
    other = sync.SharedMemoryReceiver(sync.plan(shipped.config, 1 << 16), theirs)
    sender.send(trainer, 3)
    with pytest.raises(ValueError, match="layout mismatch"):
        other.apply(engine)
    with pytest.raises(ValueError, match="the receiver refused version 3: layout mismatch"):
        sender.wait()
    receiver.close()
    sender.close()
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name)
    assert_serves(engine, expected, 2)  # the engine holds no view of the segment that is gone


# ---- bad input -------------------------------------------------------------------------------------

def _without(state, name):
    return {n: v for n, v in state.items() if n != name}


BAD_STATES = {
    "missing: final_norm": lambda s: _without(s, "final_norm"),
    "not in the layout: layers.9.wq": lambda s: s | {"layers.9.wq": s["layers.0.wq"]},
    r"embed is \(128, 256\), the layout says \(256, 128\)": lambda s: s | {"embed": s["embed"].T.copy()},
    "lm_head is float64, the buckets are float32": lambda s: s | {"lm_head": s["lm_head"].astype(np.float64)},
}


@pytest.mark.parametrize("rung", [sync.StateCopy, sync.Bucketed])
@pytest.mark.parametrize("match", list(BAD_STATES))
def test_bad_weights_are_refused_by_name_before_anything_is_sent(shipped, rung, match):
    state = {name: np.array(value) for name, value in shipped.w.items()}
    channel = rung(sync.plan(shipped.config))
    with pytest.raises(ValueError, match=match):
        channel.send(BAD_STATES[match](state), 1)
    with pytest.raises(ValueError, match="nothing to receive"):
        channel.receive()


@pytest.mark.parametrize("rung", [sync.StateCopy, sync.Bucketed])
def test_versions_must_increase_and_the_engine_stays_as_it_was(shipped, rung):
    state = {name: np.array(value) for name, value in shipped.w.items()}
    channel, engine = rung(sync.plan(shipped.config)), engine_on(shipped.config, state)
    channel.send(state, 5)
    channel.apply(engine)
    for version, match in ((5, "version 5 is not newer than version 5"), (4, "version 4 is not newer"),
                           (-1, "whole number"), (True, "whole number"), (6.0, "whole number")):
        with pytest.raises(ValueError, match=match):
            channel.send(state, version)
    before = weights_of(engine)
    stale = rung(sync.plan(shipped.config))  # another trainer that counts from 3
    stale.send({n: v + 1 for n, v in state.items()}, 3)
    with pytest.raises(ValueError, match="stale version 3: the engine serves version 5"):
        stale.apply(engine)
    assert_serves(engine, before, 5, generate=False)


@pytest.mark.parametrize("rung", [sync.StateCopy, sync.Bucketed])
def test_an_engine_of_another_model_or_a_refusing_engine_is_left_unchanged(shipped, rung):
    state = {name: np.array(value) for name, value in shipped.w.items()}
    draft = transformer.load("draft")
    other = Engine(draft)
    before = weights_of(other)
    channel = rung(sync.plan(shipped.config))
    channel.send(state, 1)
    with pytest.raises(ValueError, match="the engine serves 'draft', another model than these weights' 'target'"):
        channel.apply(other)
    assert_serves(other, before, 0, generate=False)
    engine = engine_on(shipped.config, state)
    before = weights_of(engine)
    poisoned = state | {"layers.1.wq": np.full_like(state["layers.1.wq"], np.nan)}
    channel.send(poisoned, 2)
    with pytest.raises(ValueError, match="layers.1.wq holds NaN"):
        channel.apply(engine)
    assert_serves(engine, before, 0, generate=False)


def test_the_ladder_measures_the_in_process_rungs(shipped):
    rows = sync.measure_ladder(TorchTransformer(shipped.config, shipped.w), repeats=2, spawn=False)
    assert [row.rung for row in rows] == ["state copy", "bucketed"]
    for row in rows:
        assert row.nbytes == 4_198_912 and row.seconds > 0 and row.memcpy_gbps > 0
        assert row.gbps == pytest.approx(row.nbytes / row.seconds / 1e9)
        assert row.ratio == pytest.approx(row.gbps / row.memcpy_gbps)


# ---- rungs 3 and 4 across processes ------------------------------------------------------------------

def pair_on_rank(ends) -> dict:
    """Rank 0 trains and sends, rank 1 serves: shared memory (versions 1 and 2, then 3 to a receiver
    with another layout), broadcast (4 and 5, then 6 to another layout, then a stale 4); then the
    ladder's own measuring code, once."""
    import torch.distributed as dist

    layout, other = sync.plan(TINY, 4096), sync.plan(TINY, 8192)
    first = TorchTransformer(TINY, seed=0).numpy_weights()
    out = {"weights": {}, "errors": []}

    def attempt(act):
        try:
            act()
        except ValueError as error:
            out["errors"].append(str(error))

    if dist.get_rank() == 0:
        trainer = TorchTransformer(TINY, seed=0)

        def deliver(sender, version):
            out["weights"][version] = train_step(trainer, version)
            attempt(lambda: (sender.send(trainer, version), sender.wait()))

        shm = sync.SharedMemorySender(layout, ends[0], TIMEOUT_S)
        for version in (1, 2, 3):
            deliver(shm, version)
        shm.close()
        broadcast = sync.BroadcastSender(layout)
        for version in (4, 5, 6):
            deliver(broadcast, version)
        attempt(lambda: sync.BroadcastSender(layout).send(trainer, 4))
    else:
        engine = engine_on(TINY, first)

        def take(receiver, case):
            attempt(lambda: receiver.apply(engine))
            out["weights"][case] = (engine.weight_version, weights_of(engine))

        shm = sync.SharedMemoryReceiver(layout, ends[1], TIMEOUT_S)
        take(shm, 1)
        take(shm, 2)
        take(sync.SharedMemoryReceiver(other, ends[1], TIMEOUT_S), 3)
        shm.close()
        broadcast = sync.BroadcastReceiver(layout)
        take(broadcast, 4)
        take(broadcast, 5)
        take(sync.BroadcastReceiver(other), 6)
        take(sync.BroadcastReceiver(layout), "stale")
        out["tokens"] = engine.generate(PROMPTS, GREEDY)
    out["ladder"] = sync._ladder_on_rank(TINY, first, 4096, 1, ends, TIMEOUT_S)
    return out


@pytest.mark.slow
def test_the_cross_process_rungs_deliver_the_bytes_and_refuse_a_bad_layout_on_both_sides():
    trainer, rollout = run_on_ranks(pair_on_rank, 2, multiprocessing.Pipe(), timeout_s=120)
    sent, got = trainer["weights"], rollout["weights"]
    for case, version in ((1, 1), (2, 2), (3, 2), (4, 4), (5, 5), (6, 5), ("stale", 5)):  # 3, 6, stale: refused
        assert got[case][0] == version and same(got[case][1], sent[version]), case
    assert rollout["tokens"] == engine_on(TINY, sent[5]).generate(PROMPTS, GREEDY)
    assert [error.split(":")[0] for error in trainer["errors"]] == [
        "the receiver refused version 3", "the receivers refused version 6", "the receivers refused version 4"]
    assert [error.split(":")[0] for error in rollout["errors"]] == ["layout mismatch", "layout mismatch",
                                                                   "stale version 4"]
    assert "layout mismatch" in trainer["errors"][0] and "layout mismatch" in trainer["errors"][1]
    assert "stale version" in trainer["errors"][2] and "the engine serves version 5" in rollout["errors"][2]
    assert set(trainer["ladder"]) == {"shared memory", "broadcast (gloo)", "memcpy"}
    assert all(seconds > 0 for seconds in trainer["ladder"].values()) and rollout["ladder"] is None
