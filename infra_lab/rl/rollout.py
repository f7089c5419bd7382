"""Rollouts through the book's engine: each prompt asks for n = G samples, so its prompt is
computed once and its G samples fork from the prompt's KV blocks (copy-on-write), as vLLM's
n > 1 does. Each sampled token comes back with its log-probability under the engine's weights and
the weight version that made it: what GRPO's trainer needs, and what the mismatch lab compares.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from infra_lab.rl.task import END_TOKEN, Problem
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import SamplingParams
from infra_lab.serving.steplog import StepRecord


@dataclass
class Rollout:
    problems: list[Problem]  # (P,) one per group
    group: int  # G samples per prompt
    prompts: list[list[int]]  # (P,) each prompt's tokens
    completions: list[list[int]]  # (B = P * G,): row p * G + i is sample i of prompt p
    logprobs: list[list[float]]  # (B,) the engine's log-probability of each completion token
    versions: list[list[int]]  # (B,) the weight version that produced each completion token
    prefill_tokens: int  # prompt tokens the engine computed: once per group when the samples share it
    seconds: float

    @property
    def texts(self) -> list[str]:
        return [bytes(tokens).decode("utf-8", "replace") for tokens in self.completions]

    @property
    def sample_problems(self) -> list[Problem]:
        """(B,) the problem each completion answers."""
        return [problem for problem in self.problems for _ in range(self.group)]

    @property
    def tokens(self) -> int:
        return sum(map(len, self.completions))


def engine_config(requests: int, max_tokens: int, prompt_tokens: int, block_size: int = 16) -> EngineConfig:
    """An engine that runs `requests` sequences at once: a batch slot each and the blocks they
    can fill (the shared prompt's blocks counted once per sequence, as copy-on-write may copy them)."""
    blocks_each = -(-(prompt_tokens + max_tokens) // block_size) + 1
    return EngineConfig(policy="continuous", max_batch=requests, token_budget=max(512, requests * 2),
                        num_blocks=requests * blocks_each, block_size=block_size)


def rollout(engine: Engine, problems: list[Problem], group: int, max_tokens: int, seed: int = 0,
            temperature: float = 1.0) -> Rollout:
    """Sample `group` completions of each problem's prompt through `engine`, stopping at the
    answer's newline or after `max_tokens`. A group below 2 has no baseline (GRPO compares samples
    of one prompt) and a prompt past the model's context cannot run: both raise ValueError before
    any request is added."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 2:
        raise ValueError(f"the group size must be a whole number >= 2 (GRPO's baseline is the group's mean); "
                         f"got {group!r}")
    if not problems:
        raise ValueError("no problems to roll out")
    prompts = [list(problem.prompt.encode()) for problem in problems]
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, stop_tokens=(END_TOKEN,), n=group,
                             logprobs=0, seed=seed * len(problems) * group + p * group) for p in range(len(problems))]
    logged, started = len(engine.log), time.perf_counter()
    ids = engine.add_requests(prompts, params)
    while engine.has_unfinished:
        engine.step()
    seconds = time.perf_counter() - started
    samples = [sample for request_id in ids for sample in engine.group(request_id)]
    out = Rollout(problems, group, prompts, [list(s.output) for s in samples], [list(s.logprobs) for s in samples],
                  [list(s.versions) for s in samples], prefill_tokens(engine.log[logged:]), seconds)
    for request_id in ids:
        engine.forget(request_id)
    return out


def prefill_tokens(records: list[StepRecord]) -> int:
    """Prompt tokens the engine computed over these steps."""
    return sum(work.n_tokens for record in records for work in record.work if work.kind == "prefill")
