"""Training the real small model across processes, the same steps for every method: what each
process runs for chapter 10, its tests and benchmarks/parallel.py (through
`infra_lab.processes.run_on_ranks`), and the single-process run they must follow.

Every method starts from the shipped target model and takes the same `steps` steps of AdamW on the
same global batches of `batch` windows of the training text; each of N ranks takes batch / N of
the windows and the ranks average their gradients, which gives the single-process gradient of the
whole batch. Methods: ours (plain data parallelism with and without overlap, ZeRO stages 1, 2 and
3) and torch's own (DistributedDataParallel with ZeroRedundancyOptimizer, and FSDP2's fully_shard).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from infra_lab.model import corpus
from infra_lab.model.config import CONFIGS
from infra_lab.model.torch_model import TorchTransformer
from infra_lab.model.weights import load, path_for
from infra_lab.parallel import memory
from infra_lab.parallel.comm import ByteCounter
from infra_lab.parallel.ddp import DataParallel
from infra_lab.parallel.units import unit_sizes
from infra_lab.parallel.zero import ShardedOptimizer
from infra_lab.parallel.zero3 import FullyShardedModel

OURS = ("ddp", "ddp, no overlap", "zero-1", "zero-2", "zero-3")
TORCH = ("torch ZeroRedundancyOptimizer", "torch FSDP")
METHODS = OURS + TORCH
STAGE = {"ddp": 0, "ddp, no overlap": 0, "zero-1": 1, "zero-2": 2, "zero-3": 3, TORCH[0]: 1, TORCH[1]: 3}


@dataclass(frozen=True)
class Settings:
    steps: int = 50
    batch: int = 8  # windows per step, over all ranks
    window: int = 64  # bytes per window
    lr: float = 1e-3
    seed: int = 0
    dtype: torch.dtype = torch.float32  # of the weights, gradients and optimizer states


def check_methods(methods) -> None:
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")


def batches(settings: Settings) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every step's global batch: inputs and next bytes, (batch, window) int64 each."""
    train_bytes, _ = corpus.load()
    rng = np.random.default_rng(settings.seed)
    out = []
    for _ in range(settings.steps):
        starts = rng.integers(0, len(train_bytes) - settings.window - 1, size=settings.batch)
        windows = torch.from_numpy(np.stack([train_bytes[s:s + settings.window + 1] for s in starts]).astype(np.int64))
        out.append((windows[:, :-1], windows[:, 1:]))
    return out


def shipped_model(dtype: torch.dtype = torch.float32) -> TorchTransformer:
    weights, config, _ = load(path_for("target"))
    return TorchTransformer(config, weights).to(dtype)


def precision(dtype: torch.dtype) -> memory.Precision:
    """The memory model's plain (unmixed) Adam in `dtype`: a parameter, its gradient and Adam's two
    moments of one element each; memory.FP32 for float32."""
    size = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.float32:
        return memory.FP32
    return memory.Precision(f"{str(dtype).removeprefix('torch.')} Adam", size, size, 2 * size, size)


def adamw(settings: Settings):
    return lambda params: torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.1)


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def single_process(settings: Settings) -> dict:
    """The reference: every step on the whole batch in one process."""
    model = shipped_model(settings.dtype)
    optimizer = adamw(settings)(list(model.parameters()))
    losses = []
    for x, y in batches(settings):
        loss = loss_of(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": {n: p.copy() for n, p in model.numpy_weights().items()}}


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is not None and (t.data_ptr(), t.numel()) not in seen:
            seen.add((t.data_ptr(), t.numel()))
            total += t.numel() * t.element_size()
    return total


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(parameters: list, gradients: list, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The bytes of the tensors this rank holds for training: its parameters (or slices), their
    gradients, and the optimizer's states (Adam's two moments; the step counter is left out).
    A flat buffer's padding is not a parameter and is not counted."""
    states = [_local(v) for s in optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    return {"parameters": _nbytes(_local(p) for p in parameters),
            "gradients": _nbytes(_local(g) for g in gradients if g is not None),
            "optimizer states": _nbytes(states)}


def train_rank(method: str, settings: Settings) -> dict:
    """On this rank: `method` over the steps. Its local losses, the bytes each collective sent per
    step, the bytes held after the last step (against the memory model), the mean step time
    (after the first), and, on rank 0, every weight at the end."""
    check_methods([method])
    world, rank = dist.get_world_size(), dist.get_rank()
    if settings.batch % world:
        raise ValueError(f"a batch of {settings.batch} windows does not split evenly over {world} processes")
    share = slice(rank * settings.batch // world, (rank + 1) * settings.batch // world)
    model, counter = shipped_model(settings.dtype), ByteCounter()
    sizes = unit_sizes(model)
    step, forward, holdings, optimizer = _method(method, model, counter, settings)
    losses, seconds, sent = [], [], []
    for x, y in batches(settings):
        dist.barrier()
        counter.reset()
        started = time.perf_counter()
        loss = loss_of(forward(x[share]), y[share])
        loss.backward()
        step()
        seconds.append(time.perf_counter() - started)
        losses.append(loss.item())
        sent.append({name: float(b) for name, b in counter.bytes_sent.items()} | {"volume": counter.total_volume()})
    held = held_bytes(*holdings(), optimizer)
    modelled = memory.state_bytes(sizes, world, STAGE[method], precision(settings.dtype))
    weights = _weights(method, model, forward)
    return {"method": method, "losses": losses, "sent_per_step": sent, "held": held, "modelled": modelled,
            "volume_modelled": memory.communication_volume(sizes, world, STAGE[method]) if method in OURS else None,
            "step_seconds": float(np.mean(seconds[1:])) if len(seconds) > 1 else seconds[0],
            "weights": weights if rank == 0 else None}


def compare_rank(methods: list[str], settings: Settings) -> list[dict]:
    return [train_rank(method, settings) for method in methods]


def _method(method: str, model: TorchTransformer, counter: ByteCounter, settings: Settings):
    """(step, forward, holdings, optimizer) for a method: step() runs after backward; holdings()
    gives the parameters (or slices) and the gradients this rank holds."""
    make = adamw(settings)
    if method in ("ddp", "ddp, no overlap"):
        optimizer = make(list(model.parameters()))
        data_parallel = DataParallel(model, counter, overlap=method == "ddp")

        def step():
            data_parallel.finish()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # kept, as DDP keeps its gradient buckets
        return step, model, lambda: _with_grads(model.parameters()), optimizer
    if method in ("zero-1", "zero-2"):
        sharded = ShardedOptimizer(model, int(method[-1]), counter, make)
        return sharded.step, model, lambda: (list(model.parameters()), [
            s.grad for s in sharded.shards] if method == "zero-2" else _with_grads(model.parameters())[1]), \
            sharded.optimizer
    if method == "zero-3":
        fully = FullyShardedModel(model, counter, make)
        return fully.step, fully.forward, lambda: _with_grads(fully.shards), fully.optimizer
    if method == TORCH[0]:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
        optimizer = ZeroRedundancyOptimizer(list(model.parameters()), optimizer_class=torch.optim.AdamW, lr=settings.lr,
                                            betas=(0.9, 0.95), weight_decay=0.1)

        def step():
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        return step, wrapped, lambda: _with_grads(model.parameters()), optimizer.optim
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = make(list(model.parameters()))

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return step, model, lambda: _with_grads(model.parameters()), optimizer


def _with_grads(parameters) -> tuple[list, list]:
    parameters = [p for p in parameters if p.requires_grad]
    return parameters, [p.grad for p in parameters]


def _weights(method: str, model: TorchTransformer, forward) -> dict[str, np.ndarray]:
    if method == "zero-3":
        return {n: t.numpy() for n, t in forward.__self__.full_weights().items()}
    if method == TORCH[1]:
        return {n.replace("__", "."): p.full_tensor().detach().numpy().copy() for n, p in model.weights.items()}
    return {n: p.copy() for n, p in model.numpy_weights().items()}


def disagreeing_rank(method: str) -> None:
    """Rank 1 builds a model whose MLP is wider than rank 0's: the method must refuse on every rank."""
    from dataclasses import replace

    config = CONFIGS["target"]
    if dist.get_rank() == 1:
        config = replace(config, d_ff=config.d_ff * 2)
    model, counter = TorchTransformer(config), ByteCounter()
    _method(method, model, counter, Settings())


def hooks_rank() -> dict:
    """Whether overlapped data parallelism has every unit's all-reduce under way when backward
    returns, before `finish()`; and none without overlap."""
    x, y = batches(Settings(steps=1, batch=2 * dist.get_world_size()))[0]
    out = {}
    for overlap in (True, False):
        model, counter = shipped_model(), ByteCounter()
        data_parallel = DataParallel(model, counter, overlap=overlap)
        loss_of(model(x), y).backward()
        out[overlap] = len(data_parallel.in_flight)
        data_parallel.finish()
    return {"launched in backward": out[True], "launched without overlap": out[False],
            "units": len(data_parallel.units)}


def overlap_rank(settings: Settings, rounds: int) -> dict:
    """This rank's times, medians over `rounds` after a warm-up, taking turns: forward and backward
    alone, then a barrier ("compute"), the all-reduce of every unit's gradients alone
    ("communication"), and data-parallel steps (forward, backward, gradient sync) with and without
    overlap, on copies of the model. A step's exposed communication is its time beyond compute's,
    as a share of communication's; its overhead, the same time as a share of the step's. `rounds`
    keeps each round's times, for intervals across rounds."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x, y = batches(Settings(steps=1, batch=settings.batch, window=settings.window, seed=settings.seed))[0]
    share = slice(rank * settings.batch // world, (rank + 1) * settings.batch // world)
    x, y = x[share], y[share]
    counter = ByteCounter()
    models = {name: shipped_model() for name in ("compute", "overlapped", "after backward")}
    parallel = {name: DataParallel(models[name], counter, overlap=name == "overlapped")
                for name in ("overlapped", "after backward")}
    buffers = [torch.zeros(size) for size in unit_sizes(models["compute"])]

    def compute():
        loss_of(models["compute"](x), y).backward()
        dist.barrier()

    def communication():
        for buffer in reversed(buffers):
            counter.all_reduce(buffer)

    def step(name: str):
        def run():
            loss_of(models[name](x), y).backward()
            parallel[name].finish()
        return run

    cases = {"compute": compute, "communication": communication, "overlapped": step("overlapped"),
             "after backward": step("after backward")}
    seconds = {name: [] for name in cases}
    for round_ in range(rounds + 1):  # the first round warms up
        for name, run in cases.items():
            for model in models.values():
                model.zero_grad(set_to_none=False)
            dist.barrier()
            started = time.perf_counter()
            run()
            if round_:
                seconds[name].append(time.perf_counter() - started)
    median = {name: float(np.median(values)) for name, values in seconds.items()}
    steps = ("overlapped", "after backward")
    return {"seconds": median,
            "exposed share": {n: (median[n] - median["compute"]) / median["communication"] for n in steps},
            "overhead": {n: (median[n] - median["compute"]) / median[n] for n in steps},
            "rounds": seconds}  # every timed round's seconds, by case, in order
