"""Chapter 11's loop: the task and its verifier, rollouts through the engine (the prompt computed
once per group, log-probs the trainer agrees with), the trainer's step and its refusals, the warm
start, and both layouts end to end on a few steps."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from infra_lab.model.config import CONFIGS  # noqa: E402
from infra_lab.model.transformer import Transformer, load  # noqa: E402
from infra_lab.rl import evaluate, layouts, loop, rollout as rollouts, task, warm_start  # noqa: E402
from infra_lab.rl.losses import LossConfig  # noqa: E402
from infra_lab.rl.trainer import Trainer, lay_out, token_logprobs  # noqa: E402


@pytest.fixture(scope="module")
def warm():
    return warm_start.load_warm()


def small_engine(model, requests=32):
    return loop.Engine(model, rollouts.engine_config(requests, task.max_answer_tokens(), 6))


def test_problems_split_and_verify():
    every = task.problems(2)
    assert len(every) == 90 * 90 and len(set(every)) == len(every)
    train, held = task.split(2)
    assert len(held) == task.EVAL_PROBLEMS and not set(train) & set(held) and len(train) + len(held) == len(every)
    assert task.split(2) == (train, held)  # the same held-out problems every time
    problem = task.Problem(47, 85)
    assert (problem.prompt, problem.answer) == ("47+85=", "231")
    assert task.verify(problem, "231\n") == 1.0
    assert [task.verify(problem, text) for text in ("231", "132\n", "2310\n", " 231\n")] == [0.0] * 4
    with pytest.raises(ValueError, match="digits"):
        task.problems(0)


def test_a_reward_function_that_raises_is_counted_and_scores_zero_but_nan_is_refused():
    problems = [task.Problem(10, 10), task.Problem(11, 11)]

    def flaky(problem, completion):
        if problem.a == 10:
            raise ZeroDivisionError("oops")
        return task.verify(problem, completion)

    rewards = task.score(flaky, problems, ["02\n", "22\n"])
    assert rewards.values.tolist() == [0.0, 1.0] and rewards.failures == 1 and "ZeroDivisionError" in \
        rewards.first_failure
    with pytest.raises(ValueError, match=r"'10\+10=' -> '02\\n' is nan"):
        task.score(lambda p, c: float("nan"), problems[:1], ["02\n"])


def test_a_group_computes_its_prompt_once_and_the_trainer_agrees_with_the_engines_logprobs(warm):
    problems = task.split()[0][:4]
    engine = small_engine(warm)
    batch = rollouts.rollout(engine, problems, group=8, max_tokens=task.max_answer_tokens(), seed=3)
    assert batch.prefill_tokens == sum(len(p.prompt) for p in problems)  # once per group of 8
    assert len(batch.completions) == 32 and all(len(c) == len(lp) == len(v) for c, lp, v in
                                                 zip(batch.completions, batch.logprobs, batch.versions))
    assert {v for versions in batch.versions for v in versions} == {0}
    assert engine.blocks.pool.num_free == engine.config.num_blocks  # every block back
    assert not engine.requests  # forgotten once returned
    trainer = Trainer(warm, LossConfig.grpo())
    scored = lay_out(batch)
    with torch.no_grad():
        trainer_logp = token_logprobs(trainer.policy, scored)
    gap = (trainer_logp - scored.rollout_logp)[scored.mask].abs().max().item()
    assert gap < 1e-4  # fp32 on both sides: the same distribution up to rounding


def test_rollout_refuses_a_group_below_two_and_a_prompt_past_the_context_before_adding_any(warm):
    engine = small_engine(warm)
    with pytest.raises(ValueError, match="group size must be a whole number >= 2"):
        rollouts.rollout(engine, [task.Problem(10, 10)], group=1, max_tokens=4)
    long = task.Problem(10 ** 600, 1)  # its prompt alone is past the 512-token context
    with pytest.raises(ValueError, match="exceeds the model's context of 512"):
        rollouts.rollout(engine, [task.Problem(10, 10), long], group=2, max_tokens=4)
    assert not engine.requests and not engine.has_unfinished


def test_a_training_step_moves_the_weights_and_bad_rewards_change_nothing(warm):
    problems = task.split()[0][:4]
    batch = rollouts.rollout(small_engine(warm), problems, group=4, max_tokens=4, seed=0)
    rewards = task.score(task.verify, batch.sample_problems, batch.texts).values
    trainer = Trainer(warm, LossConfig.grpo())
    before = trainer.state()
    for bad, named in ((np.r_[rewards[:-1], np.nan], "NaN or inf"), (rewards[:-1], "expected 16 rewards")):
        with pytest.raises(ValueError, match=named):
            trainer.step(batch, bad)
        assert all(np.array_equal(before[k], v) for k, v in trainer.state().items()) and trainer.version == 0
        assert not trainer.optimizer.state
    rewards[:4] = [1, 0, 0, 0]  # at least one group with a signal
    stats = trainer.step(batch, rewards)
    assert trainer.version == 1 and stats.tokens == batch.tokens
    assert any(not np.array_equal(before[k], v) for k, v in trainer.state().items())


def test_a_reference_of_another_architecture_is_refused(warm):
    other = Transformer(CONFIGS["draft"], load("draft").w)
    with pytest.raises(ValueError, match="reference model must have the policy's config; they differ in name"):
        Trainer(warm, LossConfig.grpo(), reference=other)


def test_a_cold_model_gets_no_reward_and_grpo_moves_nothing_without_kl():
    cold = load("target")
    problems = task.split()[0][:8]
    batch = rollouts.rollout(small_engine(cold, 64), problems, group=8, max_tokens=4, seed=0)
    rewards = task.score(task.verify, batch.sample_problems, batch.texts).values
    assert rewards.sum() == 0  # it has never seen a reversed sum
    trainer = Trainer(cold, LossConfig.grpo(kl_weight=0.0))
    before = trainer.state()
    trainer.step(batch, rewards)  # every advantage is 0: the gradient is 0, and AdamW's step too
    assert all(np.array_equal(before[k], v) for k, v in trainer.state().items())


def test_the_shipped_warm_start_passes_about_0_4(warm):
    assert warm.config == CONFIGS["target"]
    passed = evaluate.pass_at_1(small_engine(warm, task.EVAL_PROBLEMS), task.split()[1])
    assert passed == pytest.approx(warm.figures["pass_at_1"], abs=0.02) and 0.35 <= passed <= 0.6
    tokens, mask = warm_start.worked([task.Problem(47, 85)])
    assert bytes(tokens[0].tolist()) == b"47+85=231\n" and mask[0].tolist() == [0] * 5 + [1] * 4


def test_pass_at_k_estimate_matches_brute_force():
    from itertools import combinations

    n, correct = 6, 2
    outcomes = [1] * correct + [0] * (n - correct)
    for k in range(1, n + 1):
        subsets = list(combinations(outcomes, k))
        assert evaluate.pass_at_k_estimate(n, correct, k) == pytest.approx(np.mean([any(s) for s in subsets]))


def test_run_config_names_bad_settings():
    for settings, named in (({"group": 1}, "group size"), ({"loss": "ppo"}, "loss must be one of"),
                            ({"engine_weights": "int2"}, "engine_weights"), ({"steps": 0}, "steps"),
                            ({"kl_weight": -1.0}, "kl_weight")):
        with pytest.raises(ValueError, match=named):
            loop.RunConfig(**settings)


@pytest.mark.slow
def test_colocated_steps_learn_and_sync_every_step(warm):
    config = loop.RunConfig(steps=12, eval_every=12, eval_problems=200, seed=1)
    history = layouts.colocated(warm, config)
    (_, first), (_, last) = history.evals
    assert last > first + 0.03  # a dozen steps already help
    assert [s["version_lag"] for s in history.steps] == [0] * 12  # each batch sampled with the newest weights
    assert {e.phase for e in history.events} == {"rollout", "score", "train", "sync", "evaluate"}
    assert 0 < history.idle_share("rollout") < 1 and 0 < history.idle_share("trainer") < 1


@pytest.mark.slow
def test_disaggregated_rollout_runs_one_step_behind_on_two_processes(warm):
    config = loop.RunConfig(steps=5, eval_every=5, eval_problems=50, prompts=8, group=4)
    history = layouts.disaggregated(warm, config, timeout_s=120)
    assert [s["version_lag"] for s in history.steps] == [0, 1, 1, 1, 1]
    assert {e.process for e in history.events} == {"rollout", "trainer"}
    for process in ("rollout", "trainer"):  # a process's phases never overlap
        spans = sorted((e.start_s, e.end_s) for e in history.events if e.process == process)
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:]))
    assert len(history.final_state) == len(warm.w) and history.evals[-1][0] == 5
