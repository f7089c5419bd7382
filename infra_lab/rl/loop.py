"""GRPO's loop, end to end: roll out G answers per prompt through the engine, score them with the
verifier, take one trainer step, sync the new weights into the engine; repeat.

Two layouts of the same loop, as RL systems lay out rollout and training on their GPUs:

- colocated (verl's default, slime's colocate mode): one process takes turns. The engine's KV pool
  exists only while it rolls out (built for the rollout, released for training, as vLLM's sleep
  mode frees the KV cache), and the weights go across in memory. Neither side ever waits for the
  other, but the hardware runs one of them at a time.
- disaggregated (slime's and AReaL's separate rollout and training GPUs): two processes, one core
  each. The rollout samples batch k + 1 with weights one step old while the trainer trains on
  batch k; weights go across with a torch.distributed broadcast after each step.

Every phase is recorded as an Event on a process's timeline; `idle_share` is what is left.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from infra_lab.model.transformer import Transformer
from infra_lab.rl import rollout as rollouts, task
from infra_lab.rl.losses import LossConfig
from infra_lab.serving.engine import Engine

LOSSES = ("grpo", "dr_grpo", "reinforce")
ENGINE_WEIGHTS = ("fp32", "fp16", "int8", "int4")  # what the rollout engine serves: the trainer is always fp32


@dataclass(frozen=True)
class RunConfig:
    steps: int = 150
    prompts: int = 32  # P problems per step
    group: int = 8  # G samples per problem
    lr: float = 1e-4
    loss: str = "grpo"  # one of LOSSES
    kl_weight: float = 0.04  # beta
    truncate_c: float | None = None  # truncated importance sampling's C; None: off
    engine_weights: str = "fp32"  # one of ENGINE_WEIGHTS
    digits: int = 2
    eval_every: int = 25  # steps between pass@1 measurements (and one at the start and the end)
    eval_problems: int = task.EVAL_PROBLEMS
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "prompts", "eval_every", "eval_problems"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1; got {value!r}")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 2:
            raise ValueError(f"the group size must be a whole number >= 2 (GRPO's baseline is the group's mean); "
                             f"got {self.group!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}; got {self.loss!r}")
        if self.engine_weights not in ENGINE_WEIGHTS:
            raise ValueError(f"engine_weights must be one of {', '.join(ENGINE_WEIGHTS)}; got {self.engine_weights!r}")
        if not 1 <= self.eval_problems <= task.EVAL_PROBLEMS:
            raise ValueError(f"eval_problems must be from 1 to {task.EVAL_PROBLEMS}; got {self.eval_problems}")
        self.loss_config()  # checks kl_weight and truncate_c

    def loss_config(self) -> LossConfig:
        if self.loss == "grpo":
            return LossConfig.grpo(kl_weight=self.kl_weight, truncate_c=self.truncate_c)
        if self.loss == "dr_grpo":
            return LossConfig.dr_grpo(task.max_answer_tokens(self.digits), kl_weight=self.kl_weight,
                                      truncate_c=self.truncate_c)
        return LossConfig.reinforce(kl_weight=self.kl_weight, truncate_c=self.truncate_c)


@dataclass(frozen=True)
class Event:
    process: str  # "rollout" or "trainer" (colocated: both are the one process, taking turns)
    phase: str  # "rollout", "score", "train", "sync", "evaluate"
    start_s: float  # from the run's start
    end_s: float


@dataclass
class History:
    config: RunConfig
    layout: str
    steps: list[dict] = field(default_factory=list)  # per step: reward, loss, kl, timings...
    evals: list[tuple[int, float]] = field(default_factory=list)  # (steps trained, pass@1)
    events: list[Event] = field(default_factory=list)
    wall_s: float = 0.0
    final_state: dict | None = field(default=None, repr=False)

    def idle_share(self, process: str) -> float:
        """The share of the run's wall time in which `process` did nothing."""
        busy = sum(e.end_s - e.start_s for e in self.events if e.process == process)
        return max(0.0, 1.0 - busy / self.wall_s)

    def as_dict(self) -> dict:
        return {"config": asdict(self.config), "layout": self.layout, "steps": self.steps, "evals": self.evals,
                "events": [asdict(e) for e in self.events], "wall_s": self.wall_s,
                "idle_share": {p: self.idle_share(p) for p in ("rollout", "trainer")}}


class Timeline:
    def __init__(self, events: list[Event]):
        self.events, self.origin = events, time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def record(self, process: str, phase: str, started_s: float) -> float:
        ended = self.now()
        self.events.append(Event(process, phase, started_s, ended))
        return ended


def serving_model(state: dict, version: int, start: Transformer, engine_weights: str) -> Transformer:
    """The model the rollout engine serves for trainer weights `state`: the same floats (fp32), or
    rounded to fp16 and back (fp16 storage), or chapter 08's round-to-nearest int8 (a scale per
    output) or int4 (a scale per 32 inputs), the LM head in int8 for both."""
    if engine_weights == "fp16":
        state = {name: np.asarray(value, np.float16).astype(np.float32) for name, value in state.items()}
    model = Transformer(start.config, state, version=version)
    if engine_weights in ("int8", "int4"):
        from infra_lab.model.quantized import quantize_model

        bits, group = (8, None) if engine_weights == "int8" else (4, 32)
        model = quantize_model(model, "rtn", bits, group, head_bits=8)
        model.version = version
    return model


def rollout_engine(model: Transformer, config: RunConfig, prompt_tokens: int) -> Engine:
    """A fresh engine (and KV pool) for one rollout of P x G sequences."""
    sizing = rollouts.engine_config(config.prompts * config.group, task.max_answer_tokens(config.digits),
                                    prompt_tokens)
    return Engine(model, sizing)


def evaluation_engine(model: Transformer, config: RunConfig) -> Engine:
    return Engine(model, rollouts.engine_config(config.eval_problems, task.max_answer_tokens(config.digits),
                                                2 * config.digits + 2))
