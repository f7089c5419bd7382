"""The task chapter 11 trains on: addition with the answer's digits reversed ("47+85=" -> "231"
and a newline), checked by a verifier, not by a reward model. Reversed, the answer comes out in
the order a person adds (units first, the carry moving right), so a model that writes one byte at
a time can learn it; the verifier needs no labels beyond the sum itself.

Every problem with `digits`-digit operands exists (8,100 for two digits): a fixed 500 are held out
for evaluation, and training draws from the rest."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

EVAL_PROBLEMS = 500  # the fixed held-out set every pass@1 is measured on
END = "\n"  # the answer ends with a newline: the engine stops on it
END_TOKEN = ord(END)


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        """The sum with its digits reversed: what a correct completion holds before its newline."""
        return str(self.a + self.b)[::-1]


def problems(digits: int = 2) -> list[Problem]:
    """Every problem whose operands have exactly `digits` digits, in order."""
    if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= 4:
        raise ValueError(f"digits must be a whole number from 1 to 4; got {digits!r}")
    low, high = 10 ** (digits - 1) if digits > 1 else 0, 10 ** digits
    return [Problem(a, b) for a in range(low, high) for b in range(low, high)]


def split(digits: int = 2, held_out: int = EVAL_PROBLEMS, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """(training problems, the held-out ones): one fixed shuffle, so every run evaluates on the
    same `held_out` problems and never trains on them."""
    every = problems(digits)
    if not 1 <= held_out < len(every):
        raise ValueError(f"held_out must be from 1 to {len(every) - 1} ({digits}-digit problems); got {held_out}")
    order = np.random.default_rng(seed).permutation(len(every))
    return [every[i] for i in order[held_out:]], [every[i] for i in order[:held_out]]


def max_answer_tokens(digits: int = 2) -> int:
    """Bytes the longest answer takes, its newline included: what a rollout allows."""
    return digits + 2


def verify(problem: Problem, completion: str) -> float:
    """1.0 when the completion is exactly the reversed sum followed by the newline, else 0.0."""
    return float(completion == problem.answer + END)


@dataclass
class Rewards:
    values: np.ndarray  # (B,) one reward per completion
    failures: int  # reward calls that raised: each counted and scored 0.0
    first_failure: str = ""  # what the first one raised, for the log


def score(reward_fn, problems_: list[Problem], completions: list[str]) -> Rewards:
    """Each completion's reward from reward_fn(problem, completion). A reward function that raises
    is counted and scores 0.0: one bad answer must not stop a training run. One that returns
    something other than a finite number is a bug in the reward function, and raises ValueError
    naming the problem and the value."""
    if len(problems_) != len(completions):
        raise ValueError(f"{len(problems_)} problems but {len(completions)} completions; one each")
    values, failures, first = np.zeros(len(completions)), 0, ""
    for i, (problem, completion) in enumerate(zip(problems_, completions)):
        try:
            value = reward_fn(problem, completion)
        except Exception as error:  # noqa: BLE001 (any failure of the user's function is scored, not fatal)
            failures += 1
            first = first or f"{problem.prompt!r}: {type(error).__name__}: {error}"
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
            raise ValueError(f"the reward for {problem.prompt!r} -> {completion!r} is {value!r}; a reward must be "
                             "a finite number")
        values[i] = float(value)
    return Rewards(values, failures, first)
