"""Moving a request's K and V from a prefill worker to a decode worker (chapter 06).

The wire format, in two parts, metadata first:

1. a header, UTF-8 JSON: {"wire": 1, "transfer_id": str, "state": the request's state (what
   Engine.export_request makes: prompt, output so far, sampling parameters, its generator's
   state), "kv": null, or {"tokens": [...], "n_layers", "n_kv_heads", "head_dim", "dtype",
   "block_size"}: the layout of the K and V that follow and the sender pool's block size};
2. the K and V of every computed token, raw, C order, shaped (n_layers, 2, tokens, n_kv_heads,
   head_dim): exactly 2 x layers x KV heads x head dim x tokens x bytes per element.

The receiver checks the header against its own engine before it touches its pool (`check`): a
request for another model, K and V of another layout or dtype, or a pool with another block size
is refused by name. Two transports carry the two parts between processes:

- `GlooLink`: torch.distributed point-to-point send and recv over gloo (TCP; the same calls run
  over NCCL between GPUs). Each transfer is three messages to the decode worker's rank: the two
  sizes (int64), the header (uint8), the K and V (uint8). A receiver thread takes them from any
  rank into an inbox that requests claim by transfer id.
- `SharedMemoryLink`: the prefill worker writes header and K and V into a shared-memory segment
  named after the transfer; the decode worker maps it, copies the K and V out and unlinks it.
  Segments nobody claimed in time are unlinked by their writer and counted.

Either side gives up after a time limit, and says so by name (`TransferFailed`): a transfer
that times out is counted, never waited on forever.
"""
from __future__ import annotations

import datetime
import json
import threading
import time
from dataclasses import asdict

import numpy as np

from infra_lab.kv.paged import SequenceKV

WIRE_VERSION = 1
TRANSPORTS = ("gloo", "shm")
SHM_PREFIX = "infralab-kv-"
KV_TAG = 17  # the gloo tag of transfers, so that other messages between the same ranks pass them by


class TransferFailed(RuntimeError):
    """A transfer did not complete: the peer is gone, or the time limit passed."""


class TransferRefused(ValueError):
    """A transfer that does not fit the receiving engine (model, layout, dtype, block size)."""


# ---- the wire format ------------------------------------------------------------------------------

def pack(transfer_id: str, state: dict, kv: SequenceKV | None, block_size: int) -> tuple[bytes, np.ndarray]:
    """(header, payload): the header's JSON bytes and the K and V as a flat uint8 array (empty if none)."""
    layout = None
    payload = np.zeros(0, np.uint8)
    if kv is not None:
        layout = kv.layout | {"tokens": [int(t) for t in kv.tokens], "block_size": int(block_size)}
        payload = np.ascontiguousarray(kv.data).reshape(-1).view(np.uint8)
    header = {"wire": WIRE_VERSION, "transfer_id": transfer_id, "state": state, "kv": layout}
    return json.dumps(header).encode(), payload


def unpack(header_bytes: bytes, payload: np.ndarray) -> tuple[dict, SequenceKV | None]:
    """The header as a dict and the K and V as a SequenceKV (None if the request brought none)."""
    header = json.loads(bytes(header_bytes).decode())
    if header.get("wire") != WIRE_VERSION:
        raise TransferRefused(f"wire format {header.get('wire')!r}; this worker reads version {WIRE_VERSION}")
    layout = header["kv"]
    if layout is None:
        return header, None
    shape = (layout["n_layers"], 2, len(layout["tokens"]), layout["n_kv_heads"], layout["head_dim"])
    data = np.asarray(payload, np.uint8).view(np.dtype(layout["dtype"]))
    if data.size != int(np.prod(shape)):
        raise TransferRefused(f"transfer {header['transfer_id']}: {data.nbytes} bytes of K and V, but its header "
                              f"describes {shape} of {layout['dtype']}")
    return header, SequenceKV(data.reshape(shape), tuple(layout["tokens"]))


def check(header: dict, engine) -> None:
    """Raise TransferRefused, naming what differs (the sender's value, then this engine's), unless
    the transfer fits `engine`: the same model config, block size, and the pool's layout and dtype."""
    theirs, mine = header["state"].get("model", {}), asdict(engine.runner.config)
    if theirs != mine:
        differ = {k: (theirs.get(k), mine[k]) for k in mine if theirs.get(k) != mine[k]}
        raise TransferRefused(f"transfer {header['transfer_id']} is for another model: (sender's, this "
                              f"engine's) {differ}")
    layout = header["kv"]
    if layout is None:
        return
    pool = engine.blocks.pool
    here = {"block_size": pool.block_size, "dtype": str(pool.kv.dtype).removeprefix("torch."),
            "n_layers": pool.kv.shape[0], "n_kv_heads": pool.kv.shape[-2], "head_dim": pool.kv.shape[-1]}
    differ = {k: (layout[k], here[k]) for k in here if layout[k] != here[k]}
    if differ:
        raise TransferRefused(f"transfer {header['transfer_id']} does not fit this pool: (sender's, this "
                              f"pool's) {differ}")


class Inbox:
    """Transfers that arrived, by id, until a request claims them (or they go stale)."""

    def __init__(self):
        self._arrived: dict[str, tuple[float, bytes, np.ndarray]] = {}
        self._changed = threading.Condition()

    def put(self, transfer_id: str, header: bytes, payload: np.ndarray) -> None:
        with self._changed:
            self._arrived[transfer_id] = (time.monotonic(), header, payload)
            self._changed.notify_all()

    def claim(self, transfer_id: str, timeout_s: float) -> tuple[bytes, np.ndarray]:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while transfer_id not in self._arrived:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferFailed(f"transfer {transfer_id} did not arrive within {timeout_s:g} s")
                self._changed.wait(left)
            _, header, payload = self._arrived.pop(transfer_id)
        return header, payload

    def expire(self, older_than_s: float) -> int:
        """Drop transfers nobody claimed for `older_than_s`; how many."""
        cutoff = time.monotonic() - older_than_s
        with self._changed:
            stale = [t for t, (arrived, _, _) in self._arrived.items() if arrived < cutoff]
            for transfer_id in stale:
                del self._arrived[transfer_id]
        return len(stale)

    def __len__(self) -> int:
        with self._changed:
            return len(self._arrived)


# ---- torch.distributed over gloo --------------------------------------------------------------------

class GlooLink:
    """One torch.distributed process group over every worker of a deployment (prefill and decode
    ranks), joined through a TCP store at `master` ("host:port"; rank 0 hosts it). `receive=True`
    starts the thread that fills `inbox` (a decode worker)."""

    def __init__(self, rank: int, world: int, master: str | None, receive: bool, timeout_s: float = 60.0):
        """`master=None`: the group exists already (processes.run_on_ranks made it)."""
        import torch.distributed as dist

        if not 0 <= rank < world:
            raise ValueError(f"rank must be in 0..{world - 1} for a world of {world}; got {rank}")
        self.dist, self.rank, self.world, self.timeout_s = dist, rank, world, timeout_s
        if master is not None:
            dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self.inbox = Inbox()
        self.receive_errors = 0
        self.received = 0  # transfers taken into the inbox
        self._sending = threading.Lock()  # one transfer at a time: its three messages stay in order
        if receive:
            threading.Thread(target=self._receive_forever, daemon=True, name="kv-receiver").start()

    def send(self, dst: int, header: bytes, payload: np.ndarray, timeout_s: float) -> None:
        """The three messages to rank `dst`; TransferFailed if it is gone or they take over `timeout_s`."""
        import torch

        if not 0 <= dst < self.world or dst == self.rank:
            raise ValueError(f"the decode rank must be another rank in 0..{self.world - 1}; got {dst}")
        sizes = torch.tensor([len(header), payload.size], dtype=torch.int64)
        messages = [sizes, torch.frombuffer(bytearray(header), dtype=torch.uint8)]
        if payload.size:
            messages.append(torch.from_numpy(payload))
        limit = datetime.timedelta(seconds=timeout_s)
        with self._sending:
            try:
                for message in messages:
                    self.dist.isend(message, dst, tag=KV_TAG).wait(limit)
            except RuntimeError as error:
                raise TransferFailed(f"sending to rank {dst} failed: {str(error).splitlines()[0]}") from None

    def _receive_forever(self) -> None:
        import torch

        idle = datetime.timedelta(days=365)  # an idle link waits: a timed-out recv would close gloo's pair for good
        within = datetime.timedelta(seconds=self.timeout_s)  # the rest of a transfer that has begun
        while True:
            sizes = torch.zeros(2, dtype=torch.int64)
            try:
                first = self.dist.irecv(sizes, tag=KV_TAG)
                first.wait(idle)
                src = first.source_rank()
                header = torch.empty(int(sizes[0]), dtype=torch.uint8)
                self.dist.irecv(header, src, tag=KV_TAG).wait(within)
                payload = torch.empty(int(sizes[1]), dtype=torch.uint8)
                if payload.numel():
                    self.dist.irecv(payload, src, tag=KV_TAG).wait(within)
            except RuntimeError:  # a sender died mid-transfer: its request is retried by the front
                self.receive_errors += 1
                time.sleep(0.1)
                continue
            raw = header.numpy().tobytes()
            parsed = json.loads(raw.decode())
            self.inbox.put(parsed["transfer_id"], raw, payload.numpy())
            self.received += 1
            if parsed.get("close"):  # the last message this link takes (a finished run's)
                return

    def claim(self, transfer_id: str, timeout_s: float) -> tuple[bytes, np.ndarray]:
        return self.inbox.claim(transfer_id, timeout_s)


# ---- shared memory ------------------------------------------------------------------------------------

def _untracked(segment) -> None:
    """Python's resource tracker would unlink a segment when the process that made it exits; here
    the reader unlinks it, or the writer's sweep does (Python 3.13 has track=False). A process that
    unlinks a segment leaves it tracked: `unlink` unregisters it."""
    from multiprocessing import resource_tracker

    resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001


class SharedMemoryLink:
    """Transfers through POSIX shared memory on one machine: 16 bytes of sizes, the header, the K and V."""

    def __init__(self, stale_after_s: float = 60.0):
        self.stale_after_s = stale_after_s
        self._written: dict[str, float] = {}  # segment name -> when written
        self._lock = threading.Lock()
        self.expired = 0  # segments nobody claimed in time, unlinked by the sweep

    def send(self, transfer_id: str, header: bytes, payload: np.ndarray) -> None:
        from multiprocessing import shared_memory

        self.sweep()
        segment = shared_memory.SharedMemory(SHM_PREFIX + transfer_id, create=True,
                                             size=16 + len(header) + payload.size)
        _untracked(segment)
        try:
            view = np.ndarray((segment.size,), np.uint8, segment.buf)
            view[:16] = np.array([len(header), payload.size], np.int64).view(np.uint8)
            view[16:16 + len(header)] = np.frombuffer(header, np.uint8)
            view[16 + len(header):16 + len(header) + payload.size] = payload
            del view
        finally:
            segment.close()
        with self._lock:
            self._written[segment.name] = time.monotonic()

    def claim(self, transfer_id: str, timeout_s: float) -> tuple[bytes, np.ndarray]:
        """Map the segment, copy it out, unlink it."""
        from multiprocessing import shared_memory

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                segment = shared_memory.SharedMemory(SHM_PREFIX + transfer_id)
                break
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise TransferFailed(f"transfer {transfer_id} did not arrive within {timeout_s:g} s") from None
                time.sleep(0.005)
        try:
            view = np.ndarray((segment.size,), np.uint8, segment.buf)
            header_size, payload_size = view[:16].view(np.int64).tolist()
            header = view[16:16 + header_size].tobytes()
            payload = view[16 + header_size:16 + header_size + payload_size].copy()
            del view
        finally:
            segment.close()
            segment.unlink()
        return header, payload

    def sweep(self) -> int:
        """Unlink the segments written over `stale_after_s` ago that nobody claimed; how many."""
        from multiprocessing import shared_memory

        cutoff, gone = time.monotonic() - self.stale_after_s, 0
        with self._lock:
            stale = [name for name, written in self._written.items() if written < cutoff]
            for name in stale:
                del self._written[name]
        for name in stale:
            try:
                segment = shared_memory.SharedMemory(name)
            except FileNotFoundError:
                continue  # claimed: the reader unlinked it
            segment.close()
            segment.unlink()
            gone += 1
        self.expired += gone
        return gone
