"""steplog.step_sequences rebuilds each step's (context, new tokens) per request from the log."""
from conftest import tiny_model

from infra_lab.serving import steplog
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import SamplingParams
from infra_lab.serving.steplog import StepRecord, Work


def record(index, work, preempted=(), swapped_out=()):
    return StepRecord(index, float(index), index + 1.0, 1.0, tuple(work), preempted, swapped_out)


def test_contexts_grow_restart_on_recompute_and_survive_a_swap():
    log = [record(0, [Work(1, "prefill", 8), Work(2, "prefill", 4)]),
           record(1, [Work(1, "decode", 1), Work(2, "decode", 1)]),
           # 1 is recomputed (its K and V dropped), 2 swapped out: neither runs in this step
           record(2, [Work(3, "prefill", 6)], preempted=(1, 2), swapped_out=(2,)),
           record(3, [Work(1, "prefill", 9), Work(2, "decode", 1), Work(3, "decode", 1)])]
    assert steplog.step_sequences(log) == [[(0, 8), (0, 4)], [(8, 1), (4, 1)], [(0, 6)],
                                           [(0, 9), (5, 1), (6, 1)]]


def test_on_a_real_run_each_request_ends_where_its_tokens_do():
    """Without preemption, a request's last step starts at its prompt plus its outputs but the
    last (that token is sampled, never fed back), so context + new = prompt + outputs - 1."""
    engine = Engine(tiny_model(40), EngineConfig(policy="chunked", max_batch=4, token_budget=8,
                                                  num_blocks=64, block_size=4))
    prompts = {engine.add_request(list(range(1, 1 + n)), SamplingParams(max_tokens=m)): (n, m)
               for n, m in ((5, 3), (11, 4), (2, 6))}
    while engine.has_unfinished:
        engine.step()
    last = {}
    for step, sequences in zip(engine.log, steplog.step_sequences(engine.log)):
        assert not step.preempted
        for work, (context, new) in zip(step.work, sequences):
            assert new == work.n_tokens and context == last.get(work.request_id, 0)
            last[work.request_id] = context + new
    assert last == {rid: n + m - 1 for rid, (n, m) in prompts.items()}
