"""The loop in its two layouts (see `loop`): `colocated` takes turns in this process; `disaggregated`
runs the rollout and the trainer on two ranks of a torch.distributed group, the rollout one step
behind. Both return a `History`: per-step figures, pass@1 along the way, and every phase's Event."""
from __future__ import annotations

import pickle
import time

import numpy as np

from infra_lab.model.transformer import Transformer
from infra_lab.processes import run_on_ranks
from infra_lab.rl import evaluate, rollout as rollouts, sync, task
from infra_lab.rl.loop import History, RunConfig, Timeline, evaluation_engine, rollout_engine, serving_model
from infra_lab.rl.trainer import Trainer

READY_TAG, SIZE_TAG, BATCH_TAG = 7, 8, 9  # point-to-point messages of one tag are matched in order


def step_problems(train: list[task.Problem], config: RunConfig, step: int) -> list[task.Problem]:
    """The P problems of `step`: drawn from the training set by (seed, step) alone, so both
    layouts train on the same problems in the same order."""
    chosen = np.random.default_rng([config.seed, step]).choice(len(train), config.prompts, replace=False)
    return [train[i] for i in chosen]


def _evaluate(model: Transformer, config: RunConfig, held: list[task.Problem]) -> float:
    return evaluate.pass_at_1(evaluation_engine(model, config), held[:config.eval_problems], config.digits)


def _step_record(step: int, stats, rollout, rewards: task.Rewards, version_lag: int) -> dict:
    return {"step": step, "reward": stats.reward_mean, "loss": stats.loss, "kl": stats.kl_mean,
            "clip_fraction": stats.clip_fraction, "tis_truncated_fraction": stats.tis_truncated_fraction,
            "mismatch_abs_mean": stats.mismatch_abs_mean, "mismatch_abs_max": stats.mismatch_abs_max,
            "tokens": stats.tokens, "prefill_tokens": rollout.prefill_tokens, "reward_failures": rewards.failures,
            "rollout_s": rollout.seconds, "train_s": stats.seconds, "version_lag": version_lag}


def colocated(start: Transformer, config: RunConfig, progress: bool = False) -> History:
    """One process: per step, an engine (and its KV pool) is built, rolls out and is released;
    the trainer steps; the new weights go to the serving model through the bucketed sync."""
    from infra_lab import progress as bars

    train, held = task.split(config.digits)
    trainer = Trainer(start, config.loss_config(), lr=config.lr)
    model = serving_model(start.w, start.version, start, config.engine_weights)
    link = sync.Bucketed(sync.plan(start.config))
    history = History(config, "colocated")
    clock = Timeline(history.events)
    pending = False  # a version sent and not yet served
    for step in bars.bar(range(config.steps), desc="GRPO, colocated", show=progress):
        if step % config.eval_every == 0:
            began = clock.now()
            history.evals.append((step, _evaluate(model, config, held)))
            clock.record("rollout", "evaluate", began)
        problems = step_problems(train, config, step)
        began = clock.now()
        if pending:
            model = _serve_next(link, model, start, config)
            pending = False
            began = clock.record("rollout", "sync", began)
        engine = rollout_engine(model, config, len(problems[0].prompt))
        batch = rollouts.rollout(engine, problems, config.group, task.max_answer_tokens(config.digits),
                                 seed=config.seed * 100_003 + step)
        del engine  # the KV pool goes back before training, as vLLM's sleep mode frees it
        began = clock.record("rollout", "rollout", began)
        rewards = task.score(task.verify, batch.sample_problems, batch.texts)
        began = clock.record("trainer", "score", began)
        stats = trainer.step(batch, rewards.values)
        began = clock.record("trainer", "train", began)
        link.send(trainer.policy, trainer.version)
        pending = True
        clock.record("trainer", "sync", began)
        history.steps.append(_step_record(step, stats, batch, rewards, trainer.version - 1 - model.version))
    if pending:
        model = _serve_next(link, model, start, config)
    began = clock.now()
    history.evals.append((config.steps, _evaluate(model, config, held)))
    clock.record("rollout", "evaluate", began)
    history.wall_s, history.final_state = clock.now(), trainer.state()
    return history


def _serve_next(link, model: Transformer, start: Transformer, config: RunConfig) -> Transformer:
    """The model serving the next version: fp32 takes it in place (the engine's weight update);
    fp16, int8 and int4 rebuild from the floats, as a quantized rollout engine must."""
    state, version = link.receive()
    if config.engine_weights == "fp32":
        model.load_weights(state, version)
        return model
    return serving_model(state, version, start, config.engine_weights)


def disaggregated(start: Transformer, config: RunConfig, timeout_s: float = 600.0) -> History:
    """Two processes, one core each: rank 0 trains, rank 1 rolls out one step behind (batch k + 1
    sampled with the weights of step k - 1 while step k trains). The rollout's batches go to the
    trainer as objects; the weights come back by torch.distributed broadcast after each step."""
    if config.engine_weights != "fp32":
        raise ValueError(f"the disaggregated layout serves fp32 weights; got engine_weights={config.engine_weights!r}")
    trainer_side, rollout_side = run_on_ranks(_rank, 2, start.config, start.w, config, timeout_s=timeout_s)
    history = History(config, "disaggregated")
    history.steps, history.final_state = trainer_side["steps"], trainer_side["state"]
    history.evals = rollout_side["evals"]
    origin = min(trainer_side["origin"], rollout_side["origin"])
    for side in (trainer_side, rollout_side):  # both clocks on the earlier start (the same machine's clock)
        history.events += [e.__class__(e.process, e.phase, e.start_s + side["origin"] - origin,
                                       e.end_s + side["origin"] - origin) for e in side["events"]]
    history.wall_s = max(side["origin"] + side["wall_s"] for side in (trainer_side, rollout_side)) - origin
    model = Transformer(start.config, history.final_state, version=config.steps)
    history.evals.append((config.steps, _evaluate(model, config, task.split(config.digits)[1])))
    return history


def _rank(model_config, weights: dict, config: RunConfig) -> dict:
    import numba
    import torch
    import torch.distributed as dist

    numba.set_num_threads(1)  # one core each: the two processes share the machine's two
    torch.manual_seed(config.seed)
    start, layout = Transformer(model_config, weights), sync.plan(model_config)
    events = []
    clock = Timeline(events)
    side = {"events": events, "origin": time.time() - clock.now()}
    if dist.get_rank() == 0:
        side["steps"], side["state"] = _train_rank(start, config, layout, clock)
    else:
        side["evals"] = _rollout_rank(start, config, layout, clock)
    side["wall_s"] = clock.now()
    return side


def _both_ready(other: int) -> None:
    """Each side tells the other it is ready and waits to hear the same (the wait is idle time),
    so the broadcast that follows times the transfer, not one side waiting for the other."""
    import torch
    import torch.distributed as dist

    sent = dist.isend(torch.ones(1), other, tag=READY_TAG)
    dist.recv(torch.zeros(1), other, tag=READY_TAG)
    sent.wait()


def _send_batch(batch, dst: int) -> tuple[list, tuple]:
    """Start sending a picklable batch; returns the sends to wait on before the next one. Not
    blocking: the rollout goes on sampling while the trainer is busy with the last batch."""
    import torch
    import torch.distributed as dist

    payload = torch.frombuffer(bytearray(pickle.dumps(batch)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    # the tensors ride along: they must outlive their sends
    return [dist.isend(size, dst, tag=SIZE_TAG), dist.isend(payload, dst, tag=BATCH_TAG)], (size, payload)


def _receive_batch(src: int):
    import torch
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, tag=SIZE_TAG)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src, tag=BATCH_TAG)
    return pickle.loads(payload.numpy().tobytes())


def _train_rank(start: Transformer, config: RunConfig, layout, clock: Timeline) -> tuple[list, dict]:
    trainer = Trainer(start, config.loss_config(), lr=config.lr)
    sender, steps = sync.BroadcastSender(layout, src=0), []
    for step in range(config.steps):
        batch, rewards = _receive_batch(1)  # waiting for the batch is idle time
        began = clock.now()
        stats = trainer.step(batch, rewards.values)
        began = clock.record("trainer", "train", began)
        served = max(v for versions in batch.versions for v in versions)
        steps.append(_step_record(step, stats, batch, rewards, trainer.version - 1 - served))
        if step + 2 < config.steps:  # the rollout takes this version for batch step + 2
            _both_ready(1)
            began = clock.now()
            sender.send(trainer.policy, trainer.version)
            sender.wait()
            clock.record("trainer", "sync", began)
    return steps, trainer.state()


def _rollout_rank(start: Transformer, config: RunConfig, layout, clock: Timeline) -> list:
    train, held = task.split(config.digits)
    receiver, evals, sending = sync.BroadcastReceiver(layout, src=0), [], ([], None)
    engine = rollout_engine(start, config, 2 * config.digits + 2)  # one engine: no training shares this process
    for step in range(config.steps):
        if step >= 2:
            _both_ready(0)
            began = clock.now()
            receiver.apply(engine)
            clock.record("rollout", "sync", began)
        if step % config.eval_every == 0:
            began = clock.now()
            evals.append((engine.weight_version, _evaluate(engine.model, config, held)))
            clock.record("rollout", "evaluate", began)
        began = clock.now()
        batch = rollouts.rollout(engine, step_problems(train, config, step), config.group,
                                 task.max_answer_tokens(config.digits), seed=config.seed * 100_003 + step)
        rewards = task.score(task.verify, batch.sample_problems, batch.texts)
        clock.record("rollout", "rollout", began)
        for work in sending[0]:  # the last batch has reached the trainer (it holds one batch at a time)
            work.wait()
        sending = _send_batch((batch, rewards), 0)
    for work in sending[0]:
        work.wait()
    return evals
