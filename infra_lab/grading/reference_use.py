"""A submission that calls the package's own answer to an exercise: graded apart, not passed.

The checks compare a student's function with the package's, so a solution that imports the
package's function and returns its result passes every case. The grader reads each solution
cell's source (statically, before it runs) for the package objects that answer its exercise,
through any import form and alias, and gives that exercise the status "reference": no points,
its cases still counted, for the instructor to look at. This catches the honest shortcut, not a
determined cheat (getattr on a computed name, exec): see the README's trust model.
"""
from __future__ import annotations

import ast
import importlib

# exercise -> the package objects that answer it, as dotted names; ".name" is an attribute by that
# name on anything (a method of an object the check passes in)
ANSWERS: dict[str, tuple[str, ...]] = {
    "ch05.preempt": ("._preempt",),
    "ch05.serving_metrics": ("infra_lab.serving.metrics.summarize",),
    "ch06.tpot_and_itl": ("infra_lab.orchestration.bench_metrics.compute",
                          "infra_lab.orchestration.bench_metrics.RequestTrace"),
    "ch06.TokenBucket": ("infra_lab.orchestration.tenants.TokenBucket",),
    "ch06.cache_aware_choice": ("infra_lab.orchestration.policies.CacheAware",),
    "ch06.YourPolicy": ("infra_lab.orchestration.policies.CacheAware",),
    "ch06.splice": ("infra_lab.kv.paged.PagedKVCache", ".import_sequence"),
    "ch06.best_ratio": ("infra_lab.serving.placement.best_placement",
                        "infra_lab.serving.placement.brute_force_placement", "infra_lab.serving.placement.algorithm1"),
    "ch06.YourAutoscaler": ("infra_lab.serving.autoscaling.Forecast", "infra_lab.serving.autoscaling.KPA",
                            "infra_lab.serving.autoscaling.TargetTracking"),
    "ch07.expected_tokens": ("infra_lab.serving.speculative.expected_tokens",),
    "ch07.best_gamma": ("infra_lab.serving.speculative.best_gamma",),
    "ch07.verify_greedy": ("infra_lab.serving.speculative.accept_greedy",),
    "ch07.accept_sampling": ("infra_lab.serving.speculative.accept_sampling",),
    "ch08.quantize_int4": ("infra_lab.quant.formats.quantize_int", "infra_lab.quant.formats.pack_int4"),
    "ch08.round_e4m3": ("infra_lab.quant.formats.round_e4m3", "infra_lab.quant.formats.round_float"),
    "ch08.column_update": ("infra_lab.quant.gptq.column_update",),
    "ch08.gemv_int4": ("infra_lab.quant.matmul.matmul_numpy", "infra_lab.quant.matmul.matmul_numba",
                       "infra_lab.quant.matmul.matmul_torch"),
    "ch09.top_k_gating": ("infra_lab.moe.routing.route",),
    "ch09.switch_aux_loss": ("infra_lab.moe.routing.switch_aux_loss",),
    "ch09.dispatch": ("infra_lab.moe.dispatch.plan", "infra_lab.moe.routing.keep_within_capacity"),
    "ch09.update_bias": ("infra_lab.moe.routing.update_bias",),
    "ch10.memory_per_rank": ("infra_lab.parallel.memory.state_bytes",),
    "ch10.zero2_step": ("infra_lab.parallel.ring.reduce_scatter",),
    "ch10.parallel_linear": ("infra_lab.parallel.tensor.shard_columns", "infra_lab.parallel.tensor.shard_rows"),
    "ch10.one_f_one_b": ("infra_lab.parallel.pipeline.schedule",),
    "ch11.group_advantages": ("infra_lab.rl.losses.group_advantages", "infra_lab.rl.losses.LossConfig"),
    "ch11.grpo_loss": ("infra_lab.rl.losses.policy_loss", "infra_lab.rl.losses.k3_kl"),
    "ch11.BucketSync": ("infra_lab.rl.sync.plan", "infra_lab.rl.sync.pack", "infra_lab.rl.sync.unpack",
                        "infra_lab.rl.sync.Bucketed", "infra_lab.rl.sync.Layout"),
    "ch11.tis_weights": ("infra_lab.rl.losses.policy_loss",),
    "ch11.rl_loss": ("infra_lab.rl.losses.policy_loss", "infra_lab.rl.losses.group_advantages",
                     "infra_lab.rl.losses.LossConfig"),
}


def _python(source: str) -> ast.Module | None:
    """The cell as Python, IPython's magics and shell lines blanked; None if it does not parse."""
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """`speculative.expected_tokens` -> "infra_lab.serving.speculative.expected_tokens" when
    `speculative` was imported from there; None for a chain that starts elsewhere."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def names_used(source: str) -> set[str]:
    """Every dotted name the cell imports or reads through an import, and ".attr" for every
    attribute it reads."""
    tree = _python(source)
    if tree is None:
        return set()
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):  # `import a.b` binds a; `import a.b as c` binds c to a.b
            for alias in node.names:
                top = alias.name.split(".")[0]
                aliases[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:  # `from a import *` uses all of a
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    used = set(aliases.values())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)):
            dotted = _dotted(node, aliases)
            if dotted:
                used.add(dotted)
        if isinstance(node, ast.Attribute):
            used.add("." + node.attr)
    return used


def answers_used(exercise: str, source: str) -> list[str]:
    """The package objects answering `exercise` that its solution cell's `source` uses."""
    used = names_used(source)
    return [answer for answer in ANSWERS.get(exercise, ())
            if answer in used or answer.rpartition(".")[0] + ".*" in used
            or any(name.startswith(answer + ".") for name in used)]


def resolve(answer: str):
    """The object a dotted answer names (tests check that each one exists)."""
    module, _, name = answer.rpartition(".")
    return getattr(importlib.import_module(module), name)
