"""Chapter 07, speculative decoding: "2 to 3× faster", judged on the committed run, beside Leviathan et
al.'s and Chen et al.'s headlines."""
from __future__ import annotations

from infra_lab import verdict
from infra_lab.claims.entry import Entry, Figure, committed, judged, section_of
from infra_lab.serving import speculative

LEVIATHAN = "https://arxiv.org/abs/2211.17192"
CHEN = "https://arxiv.org/abs/2302.01318"


def speed_claim(top: str) -> verdict.Claim:
    """Chapter 07's claim, at the benchmark's best drafter and γ, e.g. "draft model/gamma 5"."""
    drafter, gamma = top.replace("gamma", "γ =").split("/")
    return verdict.Claim(
        f"speculative decoding speeds generation 2 to 3× (here {drafter} at {gamma}, "
        "one sequence at a time: the best of the γ the benchmark ran)", "C", 2.0, "at least")


def best_run() -> tuple[dict, str, dict] | None:
    """(the results, the best drafter and γ, its speed-up) of the committed speed section."""
    found = section_of("speculative", "speed")
    if found is None:
        return None
    runs = found[1]["runs"]
    top = max(runs, key=lambda run: runs[run]["speedup"]["median"])
    return found[0], top, runs[top]["speedup"]


def best_speedup() -> Figure | None:
    found = best_run()
    if found is None:
        return None
    where = found[1].replace("/gamma ", " at γ = ")
    return judged(speed_claim(found[1]), verdict.evidence(found[0], found[2], "speed"),
                  f"{where}, one sequence at a time, the best of the γ the benchmark ran")


def formula() -> Figure | None:
    found = best_run()
    if found is None:
        return None
    run, top, speedup = found
    where = top.replace("/gamma ", " at γ = ")
    return committed(run, "speed", f"{speedup['median']:.2f}× at best ({where}, one sequence at a time, a CPU); "
                     f"the formula gives {speculative.speedup(0.8, 5, 0.05):.2f}× at α = 0.8, γ = 5, c = 0.05")


def exact_sampling() -> Figure | None:
    found = section_of("speculative", "sampling")
    if found is None:
        return None
    tests = found[1]["tests"]
    ours = {name: test for name, test in tests.items() if name.endswith("/ speculative sampling")}
    p_values = [test["first"]["p_value"] for test in ours.values()]
    return committed(found[0], "sampling", f"speculative sampling's first tokens match the target's distribution "
                     f"(chi-square p = {min(p_values):.2f} at worst over {len(p_values)} prompts, 20,000 samples "
                     "each); no distributed setup or 70B model here")


ENTRIES = [
    Entry("07.two-to-three", "07", "speculative decoding speeds generation 2 to 3×", "C", "2 to 3×", best_speedup),
    Entry("07.leviathan", "07",
          "speculative decoding accelerates T5-XXL 2× to 3× over the standard T5X implementation, with identical "
          "outputs; the expected improvement is (1 − α^(γ+1)) / ((1 − α)(γc + 1))",
          "Leviathan, Kalman and Matias, ICML 2023", "2× to 3×", formula, links=(LEVIATHAN,)),
    Entry("07.chen", "07",
          "speculative sampling speeds Chinchilla 70B's decoding 2 to 2.5× in a distributed setup, preserving the "
          "target's distribution", "Chen et al., 2023, abstract", "2 to 2.5×", exact_sampling, links=(CHEN,)),
]
