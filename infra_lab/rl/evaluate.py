"""pass@1 and pass@k on the held-out problems, through the engine.

pass@1 here is greedy: the share of problems whose one greedy answer verifies (as DeepSeekMath
reports GSM8K). pass@k samples n >= k answers at temperature 1 and uses the unbiased estimator
of Chen et al. (2021), "Evaluating Large Language Models Trained on Code": per problem with c
correct of n, 1 - C(n - c, k) / C(n, k), averaged over problems."""
from __future__ import annotations

from math import comb

import numpy as np

from infra_lab.rl.task import END_TOKEN, Problem, max_answer_tokens, verify
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import SamplingParams


def answers(engine: Engine, problems: list[Problem], digits: int = 2) -> list[str]:
    """Each problem's greedy completion (up to its newline, which it keeps)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_answer_tokens(digits), stop_tokens=(END_TOKEN,))
    outputs = engine.generate([problem.prompt for problem in problems], params)
    return [bytes(tokens).decode("utf-8", "replace") for tokens in outputs]


def pass_at_1(engine: Engine, problems: list[Problem], digits: int = 2) -> float:
    """The share of `problems` whose greedy answer verifies."""
    got = answers(engine, problems, digits)
    _forget_ended(engine)
    return float(np.mean([verify(p, text) for p, text in zip(problems, got)]))


def pass_at_k_estimate(n: int, correct: int, k: int) -> float:
    """Chen et al.'s unbiased estimate of pass@k from `correct` of `n` samples."""
    if not 1 <= k <= n or not 0 <= correct <= n:
        raise ValueError(f"need 1 <= k <= n and 0 <= correct <= n; got n={n}, correct={correct}, k={k}")
    return 1.0 - comb(n - correct, k) / comb(n, k)


def pass_at_k(engine: Engine, problems: list[Problem], ks: tuple[int, ...], n: int, seed: int = 0,
              digits: int = 2) -> dict[int, float]:
    """{k: pass@k} from n samples of each problem at temperature 1 (sharing each prompt's KV)."""
    if max(ks) > n:
        raise ValueError(f"pass@{max(ks)} needs at least that many samples; got n={n}")
    params = [SamplingParams(temperature=1.0, max_tokens=max_answer_tokens(digits), stop_tokens=(END_TOKEN,),
                             n=n, seed=seed * len(problems) * n + i * n) for i in range(len(problems))]
    ids = engine.add_requests([problem.prompt for problem in problems], params)
    while engine.has_unfinished:
        engine.step()
    correct = [sum(verify(problem, bytes(sample.output).decode("utf-8", "replace"))
                   for sample in engine.group(request_id)) for problem, request_id in zip(problems, ids)]
    _forget_ended(engine)
    return {k: float(np.mean([pass_at_k_estimate(n, int(c), k) for c in correct])) for k in ks}


def _forget_ended(engine: Engine) -> None:
    for request_id in [i for i, r in engine.requests.items() if r.is_done and r.parent_id is None]:
        engine.forget(request_id)
