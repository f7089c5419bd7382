"""A cost model of one training step on a GPU cluster: memory per GPU by kind (parallel.memory)
and the step's time split into compute, exposed communication and the pipeline's bubble. It
prices the choices chapter 10 builds (ZeRO stage, tensor, pipeline and data parallel sizes,
micro-batches, recomputation) for published model shapes on H100s or H200s.

Assumptions, each shown where the model is used:
- compute: 6 FLOPs per parameter per token (forward 2, backward 4), 8 with full recomputation
  (Narayanan et al. 2021, section 5.1), at `EFFICIENCY` of the GPU's dense bf16 peak;
- tensor parallelism: per layer and micro-batch, 2 all-reduces of the activations (s b h bf16
  values) in forward and 2 in backward (a third forward's 2 with recomputation), over NVLink, on
  the critical path (Shoeybi et al. 2019, section 3);
- data parallelism and ZeRO: the volumes of ZeRO's section 7 in bf16 over each GPU's network link;
  stages 0 to 2 sync once per step, overlapped with the last micro-batch's backward; stage 3
  gathers the weights for every micro-batch, overlapped with all the compute;
- the pipeline's bubble: (p - 1) / m of the compute (Huang et al. 2019; Narayanan et al. 2021).
"""
from __future__ import annotations

from dataclasses import dataclass

from infra_lab import hardware
from infra_lab.parallel import memory

EFFICIENCY = 0.5  # share of the bf16 peak the matmuls sustain; Narayanan et al. report 44-52% on A100s
NVLINK_BYTES_PER_S = 450e9  # per GPU, each way: H100 and H200 SXM NVLink 4, 900 GB/s both ways (NVIDIA datasheets)
NETWORK_BYTES_PER_S = 50e9  # per GPU: one 400 Gb/s InfiniBand NDR port per GPU, as in a DGX H100 (NVIDIA)
GPUS_PER_NODE = 8
VOCAB = 51200  # GPT-3's tokenizer, padded (Narayanan et al. 2021)
GPUS = ("H100 SXM", "H200")


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    source: str

    @property
    def params(self) -> int:
        """12 l h^2 (1 + 13 / (12 h) + V / (12 l h)): Narayanan et al. 2021, section 5.1, without
        the position embeddings."""
        l, h = self.layers, self.hidden
        return round(12 * l * h * h * (1 + 13 / (12 * h) + VOCAB / (12 * l * h)))


SHAPES = {shape.name: shape for shape in (
    Shape("GPT-3 XL 1.3B", 24, 2048, 16, "Brown et al. 2020, Table 2.1"),
    Shape("GPT-3 2.7B", 32, 2560, 32, "Brown et al. 2020, Table 2.1"),
    Shape("GPT-3 6.7B", 32, 4096, 32, "Brown et al. 2020, Table 2.1"),
    Shape("GPT-3 175B", 96, 12288, 96, "Brown et al. 2020, Table 2.1"),
)}


@dataclass(frozen=True)
class Plan:
    shape: Shape
    sequence: int = 2048
    batch: int = 512  # sequences per step, over all GPUs
    gpus: int = 64
    stage: int = 1
    tensor: int = 1
    pipeline: int = 1
    micro_batch: int = 1  # sequences per micro-batch; each data-parallel rank runs batch / (data x this) of them
    recompute: bool = False
    gpu: str = "H100 SXM"

    @property
    def data(self) -> int:
        return self.gpus // (self.tensor * self.pipeline)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step on each data-parallel rank (gradient accumulation; the pipeline's m)."""
        return self.batch // (self.data * self.micro_batch)

    def check(self) -> None:
        if self.gpu not in GPUS:
            raise ValueError(f"unknown GPU {self.gpu!r}; choose one of {', '.join(GPUS)}")
        if self.gpus % (self.tensor * self.pipeline):
            raise ValueError(f"tensor x pipeline = {self.tensor} x {self.pipeline} must divide the {self.gpus} GPUs")
        if self.tensor > GPUS_PER_NODE:
            raise ValueError(f"tensor parallelism stays within a node: at most {GPUS_PER_NODE}; got {self.tensor}")
        if self.shape.heads % self.tensor or self.shape.hidden % self.tensor:
            raise ValueError(f"a tensor-parallel size of {self.tensor} must divide the {self.shape.heads} heads "
                             f"and the width {self.shape.hidden}")
        if self.shape.layers % self.pipeline:
            raise ValueError(f"{self.pipeline} pipeline stages cannot share {self.shape.layers} layers evenly")
        if self.micro_batch < 1 or self.batch % (self.data * self.micro_batch):
            raise ValueError(f"a batch of {self.batch} sequences does not split into {self.data} data-parallel "
                             f"ranks x micro-batches of {self.micro_batch}")


def memory_per_gpu(plan: Plan) -> dict[str, float]:
    """Bytes on the busiest GPU (the pipeline's first stage) by kind, mixed-precision Adam."""
    plan.check()
    s = plan.shape
    return memory.per_rank(s.params, s.layers, s.hidden, s.heads, plan.sequence, plan.micro_batch, plan.data,
                           plan.stage, plan.tensor, plan.pipeline, plan.micro_batches, "1f1b", plan.recompute)


def time_split(plan: Plan) -> dict[str, float]:
    """Seconds per step: compute, exposed tensor-parallel and data-parallel communication, bubble."""
    plan.check()
    s = plan.shape
    tokens = plan.batch * plan.sequence
    flops_per_gpu = (8 if plan.recompute else 6) * s.params * tokens / plan.gpus
    compute = flops_per_gpu / (EFFICIENCY * hardware.get(plan.gpu).flops("bf16"))
    t = plan.tensor
    activation_bytes = plan.sequence * plan.micro_batch * s.hidden * 2  # one all-reduce's bf16 tensor
    per_layer = (6 if plan.recompute else 4) * 2 * (t - 1) / t * activation_bytes / NVLINK_BYTES_PER_S
    tensor_comm = per_layer * s.layers / plan.pipeline * plan.micro_batches
    shard = s.params / (t * plan.pipeline)  # parameters each data-parallel group syncs
    n = plan.data
    volume = memory.communication_volume(round(shard), n, plan.stage) * 2 * (n - 1) / n  # bf16 bytes
    if plan.stage == 3:
        sync, window = volume * plan.micro_batches / NETWORK_BYTES_PER_S, compute
    else:
        sync, window = volume / NETWORK_BYTES_PER_S, compute / plan.micro_batches * 2 / 3
    bubble = (plan.pipeline - 1) / plan.micro_batches * (compute + tensor_comm)
    return {"compute": compute, "tensor-parallel communication": tensor_comm,
            "data-parallel communication": max(0.0, sync - window), "pipeline bubble": bubble}


def training_days(tokens: float, params: float, gpus: int, flops_per_gpu: float, recompute: bool = True) -> float:
    """Narayanan et al. 2021, section 5.1: end-to-end time ~ 8 T P / (n X) with recomputation
    (6 T P / (n X) without), T tokens, P parameters, n GPUs each sustaining X FLOP/s."""
    return (8 if recompute else 6) * tokens * params / (gpus * flops_per_gpu) / 86400
