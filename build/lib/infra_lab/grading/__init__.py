"""The classroom loop: property checks for exercises, student notebooks, and the grader.

`check("chNN.name", obj)` runs seeded, randomized property checks of a student's object against
the reference implementation and prints one deterministic line. `infra-lab assign` turns
solution notebooks into student notebooks; `infra-lab grade` grades a folder of submissions.
"""
from infra_lab.grading.checks import CheckResult, check, results

__all__ = ["check", "results", "CheckResult"]
