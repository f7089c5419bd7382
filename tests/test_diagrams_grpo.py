"""diagrams.grpo draws what the step's objects hold: read back by their gids, the samples are the
rollout's completions, the rewards its scores and the bars the trainer's group advantages (zero
sum in each group, to scale); the loss, optimizer and sync boxes carry the step's figures. The
timelines draw each recorded phase where it ran and label each process with its idle share over
the window. Pieces that do not belong to one step, and events that cannot be a run, are refused
by name."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from _figures import assert_legible
from infra_lab.diagrams import grpo
from infra_lab.rl.losses import group_advantages
from infra_lab.rl.rollout import Rollout
from infra_lab.rl.task import Problem, verify

PROBLEMS = [Problem(47, 85), Problem(12, 30), Problem(99, 99)]
COMPLETIONS = [["231\n", "221\n", "231\n", "13"],  # a mixed group
               ["24\n", "24\n", "24\n", "24\n"],  # all right: every advantage 0
               ["891\n", "981\n", "8\n", "891\n"]]


def a_rollout(completions=COMPLETIONS, versions=None) -> Rollout:
    flat = [list(text.encode()) for group in completions for text in group]
    return Rollout(PROBLEMS[:len(completions)], len(completions[0]),
                   [list(p.prompt.encode()) for p in PROBLEMS[:len(completions)]], flat,
                   [[-0.1] * len(t) for t in flat], versions or [[3] * len(t) for t in flat], 6, 0.01)


def a_step(rollout=None):
    rollout = rollout or a_rollout()
    rewards = np.array([verify(p, t) for p, t in zip(rollout.sample_problems, rollout.texts)])
    advantages = group_advantages(torch.tensor(rewards).reshape(-1, rollout.group)).reshape(-1)
    stats = SimpleNamespace(loss=-0.0123, tokens=rollout.tokens, kl_mean=0.004)
    return grpo.picture(rollout, rewards, advantages, stats, (4_198_912, 5)), rewards, advantages


def by_gid(figure) -> dict[str, object]:
    found = {}
    for ax in figure.axes:
        for artist in list(ax.patches) + list(ax.texts) + list(ax.lines):
            if artist.get_gid():
                found[artist.get_gid()] = artist
    return found


def test_the_step_is_its_rollout_rewards_and_advantages():
    step, rewards, advantages = a_step()
    figure = grpo.draw_step(step, groups=[0, 1, 2], title="One step")
    assert_legible(figure)
    drawn = by_gid(figure)
    texts = a_rollout().texts
    scale = float(advantages.abs().max())
    widths = {}
    for p in range(3):
        assert drawn[f"prompt:{p}_text"].get_text().startswith(PROBLEMS[p].prompt)
        for i in range(4):
            b = p * 4 + i
            assert drawn[f"sample:{p}:{i}"].get_text() == texts[b].replace("\n", grpo.END_MARK)
            assert float(drawn[f"reward:{p}:{i}"].get_text()) == rewards[b]
            assert drawn[f"advantage_value:{p}:{i}"].get_text() == f"{float(advantages[b]):+.2f}"
            widths[p, i] = drawn[f"advantage:{p}:{i}"].get_width()
            assert math.isclose(widths[p, i], 0.55 * float(advantages[b]) / scale, abs_tol=1e-9)
            green = drawn[f"cell:{p}:{i}"].get_facecolor()[1] > drawn[f"cell:{p}:{i}"].get_facecolor()[0]
            assert green == (rewards[b] > 0)
        assert abs(sum(widths[p, i] for i in range(4))) < 1e-6  # each group's advantages sum to zero
    assert all(widths[1, i] == 0 for i in range(4))  # equal rewards: no gradient from that group
    assert "version 3" in drawn["engine_text"].get_text()
    assert "version 3 → 4" in drawn["optimizer_text"].get_text()
    assert "4.2 MB in 5 buckets" in drawn["sync_text"].get_text()
    assert f"loss over {a_rollout().tokens} tokens" in drawn["loss_text"].get_text()
    assert drawn["title"].get_text() == "One step"


def test_the_default_groups_carry_the_gradient_and_one_equal_group():
    step, *_ = a_step()
    assert grpo.shown_groups(step, most=2) == [0, 1]  # the mixed group, then the all-equal one
    assert grpo.shown_groups(step, most=3) == [0, 1, 2]
    figure = grpo.draw_step(step)
    assert "every group shown" in by_gid(figure)["note"].get_text()


@pytest.mark.parametrize("change, named", [
    ({"rewards": np.zeros(5)}, "expected 12 rewards, one per completion"),
    ({"advantages": torch.zeros(11)}, "expected 12 advantages"),
    ({"advantages": torch.tensor([float("nan")] + [0.0] * 11)}, r"advantages must be finite; NaN or inf at"),
])
def test_pieces_of_another_step_are_refused(change, named):
    step_rollout = a_rollout()
    rewards = np.zeros(12)
    advantages = torch.zeros(12)
    args = {"rewards": rewards, "advantages": advantages} | change
    with pytest.raises(ValueError, match=named):
        grpo.picture(step_rollout, args["rewards"], args["advantages"],
                     SimpleNamespace(loss=0.0, tokens=1, kl_mean=0.0), (8, 1))


def test_a_rollout_of_two_versions_and_bad_groups_are_refused():
    mixed = a_rollout(versions=[[3] * 4] * 11 + [[4] * 4])
    with pytest.raises(ValueError, match=r"came from versions \[3, 4\]"):
        grpo.picture(mixed, np.zeros(12), torch.zeros(12), SimpleNamespace(loss=0.0, tokens=1, kl_mean=0.0), (8, 1))
    step, *_ = a_step()
    with pytest.raises(ValueError, match="distinct indices from 0 to 2"):
        grpo.draw_step(step, groups=[0, 3])
    big = a_rollout([["24\n"] * 16] * 2)
    with pytest.raises(ValueError, match="2 groups of 16 make 32 rows; at most 24"):
        grpo.draw_step(a_step(big)[0], groups=[0, 1])


EVENTS = [{"process": "rollout", "phase": "evaluate", "start_s": 0.0, "end_s": 1.0},
          {"process": "rollout", "phase": "rollout", "start_s": 1.0, "end_s": 2.0},
          {"process": "trainer", "phase": "score", "start_s": 2.0, "end_s": 2.1},
          {"process": "trainer", "phase": "train", "start_s": 2.1, "end_s": 3.0},
          {"process": "trainer", "phase": "sync", "start_s": 3.0, "end_s": 3.1},
          {"process": "rollout", "phase": "sync", "start_s": 3.1, "end_s": 3.2},
          {"process": "rollout", "phase": "rollout", "start_s": 3.2, "end_s": 4.0}]
APART = [{"process": "trainer", "phase": "train", "start_s": 1.5, "end_s": 3.5},
         {"process": "rollout", "phase": "rollout", "start_s": 0.0, "end_s": 1.5},
         {"process": "rollout", "phase": "rollout", "start_s": 1.6, "end_s": 3.2}]


def test_the_timelines_draw_each_phase_where_it_ran():
    figure = grpo.draw_timelines({"colocated": EVENTS, "disaggregated": APART})
    assert_legible(figure)
    drawn = by_gid(figure)
    assert grpo.recorded_until(EVENTS) == 3.1 and grpo.recorded_until(APART) == 3.2
    for k, e in enumerate(EVENTS):  # the window: 0 to 3.1 s, the earlier of the two runs' records
        box = drawn.get(f"event:colocated:{e['process']}:{k}")
        if e["start_s"] >= 3.1:
            assert box is None
            continue
        assert math.isclose(box.get_x(), e["start_s"]) and math.isclose(box.get_width(),
                                                                        min(e["end_s"], 3.1) - e["start_s"])
    idle = {g.split(":")[2]: float(g.split(":")[3]) for g in drawn if g.startswith("idle:colocated:")}
    assert math.isclose(idle["rollout"], 1 - 2.0 / 3.1) and math.isclose(idle["trainer"], 1 - 1.1 / 3.1)
    assert drawn["idle:colocated:rollout:" + repr(idle["rollout"])].get_text().endswith(f"{idle['rollout']:.0%}")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 3)), min_size=1, max_size=8),
       st.floats(0, 5), st.floats(0.1, 10))
def test_the_idle_share_is_the_uncovered_share_of_the_window(spans, start, length):
    events, at = [], 0.0
    for gap, width in spans:  # one process's phases never overlap
        events.append({"process": "trainer", "phase": "train", "start_s": at + gap, "end_s": at + gap + width})
        at += gap + width
    grid = np.linspace(start, start + length, 20_001)[:-1] + length / 40_000  # midpoints
    covered = np.zeros_like(grid, dtype=bool)
    for e in events:
        covered |= (grid >= e["start_s"]) & (grid < e["end_s"])
    expected = 1 - covered.mean()
    assert abs(grpo.window_idle_share(events, "trainer", start, start + length) - expected) < 2e-3


@pytest.mark.parametrize("events, named", [
    ([], "no events to draw"),
    ([{"process": "rollout", "phase": "nap", "start_s": 0, "end_s": 1}], "phase 'nap'; allowed are"),
    ([{"process": "rollout", "phase": "train", "start_s": 2, "end_s": 1}], "event 0 .* ends at 1 s, before it starts"),
])
def test_events_that_are_no_run_are_refused(events, named):
    with pytest.raises(ValueError, match=named):
        grpo.draw_timelines({"colocated": events})
