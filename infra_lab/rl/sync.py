"""Weight sync: the trainer's new weights into the rollout engine after every GRPO step (chapter 11).

The engine must serve the new weights before it samples again, so the sync sits on every step's
critical path. verl measured its Qwen2.5-7B sync at 13.5 s over gloo against 0.79 s over NCCL;
slime cut a 30B model's from 60 s to 7 s by packing parameters into buckets handed over by CUDA
IPC. The ladder here, each rung ending in Engine.update_weights (which checks the state, derives
the fused copies and flushes the prefix cache), each timed against a plain memory copy of the same
bytes by `measure_ladder`:

1. `StateCopy`, one process: name -> a detached numpy copy; where every system starts.
2. `Bucketed`, one process: the weights packed into a few flat float32 buckets, allocated once and
   reused, by a `Layout` (name, bucket, offset, shape) both sides agree on: slime's buckets.
3. `SharedMemorySender`/`Receiver`, two processes: the buckets live in a shared-memory segment made
   once; a Pipe says which version is complete: what CUDA IPC does between GPU processes.
4. `BroadcastSender`/`Receiver`: bucket by bucket from the trainer's rank into preallocated buckets
   with torch.distributed, gloo on CPU, NCCL when the buckets are on cuda: verl's path.

The engine keeps the arrays it is given, so a receiver never hands it a view of a reused bucket: it
copies the buckets out (vLLM's load_weights copies into its own parameters too), and a sender
overwrites its buckets only once the receiver has applied the last version. A layout that is not
the sender's, a version not newer than the last, or an engine serving another model is refused by
name on both sides, the engine unchanged. Each send and apply returns a `Sync` (version, bytes, s).
"""
from __future__ import annotations

import hashlib
import statistics
import time
from dataclasses import dataclass

import numpy as np

from infra_lab.model.config import ModelConfig, weight_shapes

BUCKET_BYTES = 1 << 20
REFUSALS = ("", "layout mismatch", "stale version", "the engine serves", "the engine refused")  # codes over dist


@dataclass(frozen=True)
class Sync:
    version: int
    nbytes: int
    seconds: float  # this side's part; a receiver's includes waiting for the weights


@dataclass(frozen=True)
class Slot:
    name: str
    bucket: int
    offset: int  # in float32 elements from the bucket's start
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class Layout:
    """Where each weight of `model` lives in the float32 buckets; overlapping or repeated slots are refused."""
    model: str
    slots: tuple[Slot, ...]

    def __post_init__(self):
        names = [s.name for s in self.slots]
        ordered = sorted(self.slots, key=lambda s: (s.bucket, s.offset))
        problems = [f"{n} appears twice" for n in sorted({n for n in names if names.count(n) > 1})] + \
            [f"{s.name} has a negative bucket, offset or size" for s in self.slots
             if min(s.bucket, s.offset, *s.shape) < 0] + \
            [f"{a.name} and {b.name} overlap in bucket {a.bucket}" for a, b in zip(ordered, ordered[1:])
             if a.bucket == b.bucket and b.offset < a.offset + a.size]
        if problems:
            raise ValueError(f"bad layout for {self.model}: " + "; ".join(problems))

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {s.name: tuple(s.shape) for s in self.slots}

    @property
    def sizes(self) -> list[int]:
        """Float32 elements of each bucket."""
        ends = [0] * (1 + max((s.bucket for s in self.slots), default=-1))
        for s in self.slots:
            ends[s.bucket] = max(ends[s.bucket], s.offset + s.size)
        return ends

    @property
    def nbytes(self) -> int:
        return 4 * sum(self.sizes)

    @property
    def fingerprint(self) -> int:
        """56 bits of a hash of the layout: what two processes compare (it fits an int64)."""
        return int.from_bytes(hashlib.sha256(repr((self.model, self.slots)).encode()).digest()[:7], "big")

    def check(self, weights: dict) -> None:
        """ValueError naming each weight that is missing, not in the layout, misshapen, or not float32."""
        got = {name: tuple(getattr(v, "shape", np.shape(v))) for name, v in weights.items()}
        missing, extra = sorted(set(self.shapes) - set(got)), sorted(set(got) - set(self.shapes))
        problems = ([f"missing: {', '.join(missing)}"] if missing else []) + \
            ([f"not in the layout: {', '.join(extra)}"] if extra else []) + \
            [f"{n} is {got[n]}, the layout says {s}" for n, s in self.shapes.items() if n in got and got[n] != s] + \
            [f"{n} is {_dtype(v)}, the buckets are float32" for n, v in weights.items()
             if n in self.shapes and _dtype(v) != "float32"]
        if problems:
            raise ValueError(f"weights refused for {self.model} (nothing sent): " + "; ".join(problems))


def plan(config: ModelConfig, bucket_bytes: int = BUCKET_BYTES) -> Layout:
    """`config`'s weights in order, in buckets of `bucket_bytes`; a weight larger than a bucket gets its own."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 4:
        raise ValueError(f"bucket_bytes must be a whole number >= 4; got {bucket_bytes!r}")
    slots, bucket, used = [], 0, 0
    for name, shape in weight_shapes(config).items():
        size = int(np.prod(shape, dtype=np.int64))
        if used and used + size > bucket_bytes // 4:
            bucket, used = bucket + 1, 0
        slots.append(Slot(name, bucket, used, tuple(shape)))
        used += size
    return Layout(config.name, tuple(slots))


def _dtype(value) -> str:
    return str(getattr(value, "dtype", np.asarray(value).dtype)).removeprefix("torch.")


def _numpy(value) -> np.ndarray:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)


def weights_of(model_or_state) -> dict:
    """name -> array or tensor: a TorchTransformer's parameters (detached), a Transformer's `w`, or a state."""
    if isinstance(model_or_state, dict):
        return model_or_state
    if hasattr(model_or_state, "weights"):
        return {name.replace("__", "."): p.detach() for name, p in model_or_state.weights.items()}
    if hasattr(model_or_state, "w"):
        return model_or_state.w
    raise ValueError(f"weights come from a TorchTransformer, a Transformer or a dict; got {type(model_or_state)}")


def pack(layout: Layout, weights: dict, buckets: list) -> None:
    """Copy each weight into its slot (buckets: flat numpy arrays, or torch tensors)."""
    for s in layout.slots:
        target = buckets[s.bucket][s.offset:s.offset + s.size].reshape(s.shape)
        if hasattr(target, "copy_"):
            import torch

            target.copy_(torch.as_tensor(weights[s.name]))
        else:
            np.copyto(target, _numpy(weights[s.name]))


def unpack(layout: Layout, buckets: list) -> dict:
    """A private copy of the buckets (one flat array), each weight a view of it: what the engine keeps."""
    starts = np.cumsum([0] + layout.sizes)
    flat = np.empty(int(starts[-1]), np.float32)
    for i, bucket in enumerate(buckets):
        flat[starts[i]:starts[i + 1]] = _numpy(bucket)
    return {s.name: flat[starts[s.bucket] + s.offset:][:s.size].reshape(s.shape) for s in layout.slots}


class _Sender:
    """A sender's part: check, deliver, and before overwriting its buckets, wait for the last answer."""
    sent: int | None = None  # the last version sent
    _waiting: int | None = None  # a version sent whose answer has not been read

    def send(self, model_or_state, version: int) -> Sync:
        """Deliver the weights of a TorchTransformer (or a dict name -> array) as `version`."""
        start = time.perf_counter()
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise ValueError(f"a weight version is a whole number >= 0; got {version!r}")
        if self.sent is not None and version <= self.sent:
            raise ValueError(f"version {version} is not newer than version {self.sent}, sent before")
        weights = weights_of(model_or_state)
        self.layout.check(weights)
        self.wait()  # the last version's answer first: its buckets may still be read
        self._deliver(weights, int(version))
        self.sent = self._waiting = int(version)
        return Sync(self.sent, self.layout.nbytes, time.perf_counter() - start)

    def wait(self) -> None:
        """Until the receiver has applied the last version sent; ValueError with its reason if it refused it."""
        version, self._waiting = self._waiting, None
        if version is not None:
            self._answer(version)

    def _answer(self, version: int) -> None:
        pass

    def close(self) -> None:
        pass


class _Receiver:
    """A receiver's part: hear of a version, judge it, read it, hand it to the engine, answer."""
    version: int | None = None  # the last version received

    def receive(self) -> tuple[dict, int]:
        """The next version's weights (a private copy) and its number."""
        return self._sync(None, "continue")

    def apply(self, engine, in_flight: str = "continue") -> Sync:
        """Receive the next version and serve it from `engine` (Engine.update_weights)."""
        start = time.perf_counter()
        _, version = self._sync(engine, in_flight)
        return Sync(version, self.layout.nbytes, time.perf_counter() - start)

    def _sync(self, engine, in_flight: str) -> tuple[dict, int]:
        version, fingerprint = self._arrive()
        problem = self._verdict(self._judge(version, fingerprint, engine))
        if problem:
            raise ValueError(problem)
        state = self._read()
        try:
            if engine is not None:
                engine.update_weights(state, version, in_flight)
        except ValueError as error:
            self._done(f"the engine refused version {version}: {error}")
            raise
        self._done(None)
        self.version = version
        return state, version

    def _judge(self, version: int, fingerprint: int, engine) -> str | None:
        mine, config = self.layout, getattr(getattr(engine, "model", None), "config", None)
        if fingerprint != mine.fingerprint:
            return (f"layout mismatch: the sender's layout (fingerprint {fingerprint:x}) is not this receiver's "
                    f"({mine.model}, buckets of {mine.sizes} floats, fingerprint {mine.fingerprint:x})")
        if self.version is not None and version <= self.version:
            return f"stale version {version}: this receiver already took version {self.version}"
        if engine is not None and (config is None or config.name != mine.model or weight_shapes(config) != mine.shapes):
            return (f"the engine serves {getattr(config, 'name', None)!r}, another model than these weights' "
                    f"{mine.model!r}; it is unchanged")
        if engine is not None and version <= engine.weight_version:
            return f"stale version {version}: the engine serves version {engine.weight_version}"
        return None

    def _verdict(self, problem: str | None) -> str | None:
        return problem

    def _done(self, problem: str | None) -> None:
        pass

    def close(self) -> None:
        pass


class StateCopy(_Sender, _Receiver):
    """Rung 1, one process: send() takes a detached numpy copy of every weight; apply(engine) serves it.
    A version sent and not yet applied is replaced by the next one sent."""

    def __init__(self, layout: Layout):
        self.layout = layout

    def _deliver(self, weights: dict, version: int) -> None:
        self._state = {name: np.array(_numpy(value)) for name, value in weights.items()}

    def _read(self) -> dict:
        return self._state

    def _arrive(self) -> tuple[int, int]:
        if self._waiting is None:
            raise ValueError(f"nothing to receive: nothing was sent after version {self.sent}")
        return self._waiting, self.layout.fingerprint

    def _done(self, problem: str | None) -> None:
        if problem is None:
            self._waiting = None


class Bucketed(StateCopy):
    """Rung 2, one process: send() packs the weights into buckets allocated once; apply() copies them out."""

    def __init__(self, layout: Layout):
        self.layout, self.buckets = layout, [np.empty(n, np.float32) for n in layout.sizes]

    def _deliver(self, weights: dict, version: int) -> None:
        pack(self.layout, weights, self.buckets)

    def _read(self) -> dict:
        return unpack(self.layout, self.buckets)


def _bucket_views(layout: Layout, buffer) -> list[np.ndarray]:
    starts = np.cumsum([0] + layout.sizes)
    flat = np.ndarray((int(starts[-1]),), np.float32, buffer=buffer)
    return [flat[starts[i]:starts[i + 1]] for i in range(len(layout.sizes))]


class SharedMemorySender(_Sender):
    """Rung 3, the trainer: one segment made here and written each send; `conn` (a Pipe's end) names the
    version complete and brings the receiver's answer. close() unlinks the segment."""

    def __init__(self, layout: Layout, conn, timeout_s: float = 60.0):
        from multiprocessing import shared_memory

        self.layout, self.conn, self.timeout_s = layout, conn, timeout_s
        self.segment = shared_memory.SharedMemory(create=True, size=max(layout.nbytes, 4))
        self.buckets = _bucket_views(layout, self.segment.buf)

    def _deliver(self, weights: dict, version: int) -> None:
        pack(self.layout, weights, self.buckets)
        self.conn.send((version, self.layout.fingerprint, self.segment.name))

    def _answer(self, version: int) -> None:
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"no answer from the receiver about version {version} within {self.timeout_s:g} s")
        problem = self.conn.recv()
        if problem is not None:
            raise ValueError(f"the receiver refused version {version}: {problem}")

    def close(self) -> None:
        if self.segment is not None:
            self.buckets = []  # the views go before the mapping does
            self.segment.close()
            self.segment.unlink()
            self.segment = None


class SharedMemoryReceiver(_Receiver):
    """Rung 3, the rollout: maps the segment its message names and copies each version out of it."""

    def __init__(self, layout: Layout, conn, timeout_s: float = 60.0):
        self.layout, self.conn, self.timeout_s, self.segment, self.buckets = layout, conn, timeout_s, None, []

    def _arrive(self) -> tuple[int, int]:
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"no weights arrived within {self.timeout_s:g} s")
        version, fingerprint, self._name = self.conn.recv()
        return version, fingerprint

    def _verdict(self, problem: str | None) -> str | None:
        if problem:
            self.conn.send(problem)
        return problem

    def _read(self) -> dict:
        from multiprocessing import shared_memory

        if self.segment is None or self.segment.name != self._name:
            self.close()
            self.segment = shared_memory.SharedMemory(self._name)
            self.buckets = _bucket_views(self.layout, self.segment.buf)
        return unpack(self.layout, self.buckets)

    def _done(self, problem: str | None) -> None:
        self.conn.send(problem)

    def close(self) -> None:
        self.buckets = []
        if self.segment is not None:
            self.segment.close()  # the sender unlinks it
            self.segment = None


class _Ranks:
    """Rung 4's common part: buckets preallocated on `device`, collectives on `group` from rank `src`."""

    def __init__(self, layout: Layout, src: int = 0, group=None, device: str = "cpu"):
        import torch
        import torch.distributed

        self.layout, self.src, self.group, self.device, self.torch = layout, src, group, device, torch
        self.buckets = [torch.empty(n, dtype=torch.float32, device=device) for n in layout.sizes]

    def _all_max(self, code: int) -> int:
        flag = self.torch.tensor([code], dtype=self.torch.int64, device=self.device)
        self.torch.distributed.all_reduce(flag, op=self.torch.distributed.ReduceOp.MAX, group=self.group)
        return int(flag.item())

    def _broadcast(self, tensors) -> None:
        for tensor in tensors:
            self.torch.distributed.broadcast(tensor, self.src, group=self.group)


class BroadcastSender(_Ranks, _Sender):
    """Rung 4, the trainer's rank `src`: a header (version, layout fingerprint), the receivers' verdict,
    then each bucket broadcast to every rank of `group`; wait() collects whether they applied it."""

    def _deliver(self, weights: dict, version: int) -> None:
        header = [version, self.layout.fingerprint]
        self._broadcast([self.torch.tensor(header, dtype=self.torch.int64, device=self.device)])
        code = self._all_max(0)
        if code:
            raise ValueError(f"the receivers refused version {version}: {REFUSALS[code]} (their errors say more)")
        pack(self.layout, weights, self.buckets)
        self._broadcast(self.buckets)

    def _answer(self, version: int) -> None:
        if self._all_max(0):
            raise ValueError(f"a receiver's engine refused version {version} (its error names why)")


class BroadcastReceiver(_Ranks, _Receiver):
    """Rung 4, a rollout's rank: receives into buckets allocated once, then copies them out."""

    def _arrive(self) -> tuple[int, int]:
        header = self.torch.empty(2, dtype=self.torch.int64, device=self.device)
        self._broadcast([header])
        return tuple(header.tolist())

    def _verdict(self, problem: str | None) -> str | None:
        mine = next((i for i, kind in enumerate(REFUSALS) if i and problem.startswith(kind)), 4) if problem else 0
        code = self._all_max(mine)
        return problem or (f"another receiver refused this version: {REFUSALS[code]}" if code else None)

    def _read(self) -> dict:
        self._broadcast(self.buckets)
        return unpack(self.layout, self.buckets)

    def _done(self, problem: str | None) -> None:
        self._all_max(4 if problem else 0)


# ---- the ladder, measured ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    rung: str
    nbytes: int
    seconds: float  # median of the repeats: from send until the engine serves the version
    gbps: float
    memcpy_gbps: float  # numpy's copy of as many bytes into a preallocated buffer, in the same process
    ratio: float  # gbps / memcpy_gbps


def _median(sync_once, first_version: int, repeats: int) -> float:
    """The median seconds of `repeats` syncs, after one more to warm up."""
    times = []
    for version in range(first_version, first_version + repeats + 1):
        start = time.perf_counter()
        sync_once(version)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def memcpy_seconds(nbytes: int, repeats: int = 5) -> float:
    source, target = np.ones(max(nbytes // 4, 1), np.float32), np.empty(max(nbytes // 4, 1), np.float32)
    return _median(lambda _: np.copyto(target, source), 0, repeats)


def _row(rung: str, nbytes: int, seconds: float, memcpy: float) -> Row:
    return Row(rung, nbytes, seconds, nbytes / seconds / 1e9, nbytes / memcpy / 1e9, memcpy / seconds)


def _ladder_on_rank(config, state, bucket_bytes, repeats, ends, timeout_s) -> dict | None:
    """Rungs 3 and 4 between rank 0 (a torch trainer) and rank 1 (an engine): rank 0's median seconds."""
    import torch.distributed as dist

    from infra_lab.model.torch_model import TorchTransformer
    from infra_lab.model.transformer import Transformer
    from infra_lab.serving.engine import Engine

    layout = plan(config, bucket_bytes)
    if dist.get_rank() == 0:
        trainer, senders = TorchTransformer(config, state), [SharedMemorySender(layout, ends[0], timeout_s)]
        try:
            times = {"shared memory": _median(lambda v: (senders[0].send(trainer, v), senders[0].wait()), 1, repeats)}
        finally:
            senders[0].close()
        senders.append(BroadcastSender(layout))
        times["broadcast (gloo)"] = _median(lambda v: (senders[1].send(trainer, v), senders[1].wait()),
                                            repeats + 2, repeats)
        return times | {"memcpy": memcpy_seconds(layout.nbytes, repeats)}
    engine, receiver = Engine(Transformer(config, state)), SharedMemoryReceiver(layout, ends[1], timeout_s)
    try:
        for _ in range(repeats + 1):
            receiver.apply(engine)
    finally:
        receiver.close()
    receiver = BroadcastReceiver(layout)
    for _ in range(repeats + 1):
        receiver.apply(engine)
    return None


def measure_ladder(model, repeats: int = 5, bucket_bytes: int = BUCKET_BYTES, spawn: bool = True,
                   timeout_s: float = 60.0) -> list[Row]:
    """Every rung delivering `model`'s weights (a TorchTransformer or a Transformer) into an engine: rungs 1
    and 2 in this process, then (spawn) 3 and 4 between two spawned gloo ranks; one Row each."""
    import multiprocessing

    from infra_lab.model.transformer import Transformer
    from infra_lab.processes import run_on_ranks
    from infra_lab.serving.engine import Engine

    state = {name: np.array(_numpy(value), np.float32) for name, value in weights_of(model).items()}
    layout, rows = plan(model.config, bucket_bytes), []
    for rung, channel in (("state copy", StateCopy(layout)), ("bucketed", Bucketed(layout))):
        engine = Engine(Transformer(model.config, dict(state)))
        seconds = _median(lambda v: (channel.send(model, v), channel.apply(engine)), 1, repeats)  # noqa: B023
        rows.append(_row(rung, layout.nbytes, seconds, memcpy_seconds(layout.nbytes, repeats)))
    if not spawn:
        return rows
    ends = multiprocessing.Pipe()
    times = run_on_ranks(_ladder_on_rank, 2, model.config, state, bucket_bytes, repeats, ends, timeout_s,
                         timeout_s=timeout_s)[0]
    return rows + [_row(rung, layout.nbytes, times[rung], times["memcpy"])
                   for rung in ("shared memory", "broadcast (gloo)")]
