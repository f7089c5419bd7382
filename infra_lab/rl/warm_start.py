"""The warm start: supervised fine-tuning of the book's target model (trained on Python's standard
library, it has never seen a reversed sum) on worked problems, stopped as soon as greedy pass@1 on
the held-out problems reaches a target (0.4). RL needs it: a model that never answers right gets
reward 0 on every sample, every group's advantages are 0, and GRPO's gradient is the KL term's
alone. The shipped file (`WARM_PATH`) is this function's output with its defaults."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from infra_lab.model import weights as weight_files
from infra_lab.model.transformer import Transformer, load
from infra_lab.rl import evaluate, task
from infra_lab.rl.loop import RunConfig, evaluation_engine

WARM_PATH = weight_files.WEIGHTS_DIR / "adder.npz"


def worked(problems: list[task.Problem]):
    """(tokens (B, L), mask (B, L - 1)): each prompt with its answer, the loss on the answer's bytes."""
    import torch

    texts = [(p.prompt, p.answer + task.END) for p in problems]
    width = max(len(q) + len(a) for q, a in texts)
    tokens = torch.zeros(len(texts), width, dtype=torch.int64)
    mask = torch.zeros(len(texts), width - 1)
    for i, (question, answer) in enumerate(texts):
        sequence = list((question + answer).encode())
        tokens[i, :len(sequence)] = torch.tensor(sequence)
        mask[i, len(question) - 1:len(sequence) - 1] = 1  # predictions of the answer's bytes
    return tokens, mask


def train(target_pass: float = 0.4, seed: int = 0, lr: float = 1e-3, batch: int = 64, check_every: int = 5,
          first_check: int = 100, max_steps: int = 1000, digits: int = 2, progress: bool = False) -> tuple:
    """(the warm-started Transformer, its figures): AdamW on worked training problems until greedy
    pass@1 on the held-out ones first reaches `target_pass` (checked every `check_every` steps)."""
    import torch
    import torch.nn.functional as F

    from infra_lab import progress as bars
    from infra_lab.model.torch_model import TorchTransformer
    from infra_lab.rl.trainer import contiguous

    if not 0 < target_pass < 1:
        raise ValueError(f"target_pass must be in (0, 1); got {target_pass!r}")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    start = load("target")
    train_problems, held = task.split(digits)
    model = TorchTransformer(start.config, contiguous(start.w))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    started, checks = time.perf_counter(), []
    for step in bars.bar(range(1, max_steps + 1), desc="warm start", show=progress):
        tokens, mask = worked([train_problems[i] for i in rng.integers(0, len(train_problems), batch)])
        logits = model(tokens[:, :-1])
        nll = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")  # (B, L - 1)
        loss = (nll * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step >= first_check and step % check_every == 0:
            now = Transformer(start.config, model.numpy_weights())
            passed = evaluate.pass_at_1(evaluation_engine(now, RunConfig(digits=digits)), held, digits)
            checks.append((step, passed))
            if passed >= target_pass:
                figures = {"steps": step, "pass_at_1": passed, "checks": checks, "seed": seed, "lr": lr,
                           "batch": batch, "seconds": time.perf_counter() - started}
                return now, figures
    raise RuntimeError(f"pass@1 stayed below {target_pass} for {max_steps} steps; last checks {checks[-3:]}")


def save(model: Transformer, figures: dict, path: Path = WARM_PATH) -> None:
    weight_files.save(model.w, model.config, path, figures)


def load_warm(path: Path = WARM_PATH) -> Transformer:
    """The shipped warm start (version 0)."""
    if not path.is_file():
        raise FileNotFoundError(f"no warm start at {path}; `python -m infra_lab.rl.warm_start` rebuilds it "
                                "(about a minute on two cores)")
    weights, config, figures = weight_files.load(path)
    return Transformer(config, weights, figures)


if __name__ == "__main__":
    warm, warm_figures = train(progress=True)
    save(warm, warm_figures)
    print(f"{WARM_PATH}: pass@1 {warm_figures['pass_at_1']:.3f} after {warm_figures['steps']} steps")
