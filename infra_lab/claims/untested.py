"""Claims of the articles that no chapter can test on the book's hardware, each with the reason."""
from __future__ import annotations

from infra_lab.claims.entry import Entry

NO_SYSTEM = "the article names no system, model, hardware or baseline to rebuild or measure"

ENTRIES = [
    Entry("none.per-card-300", "", "one team's inference architecture raised per-card throughput 300%", "A", "300%",
          not_here=NO_SYSTEM),
    Entry("none.heterogeneous-10x", "",
          "heterogeneous computing, CPUs, GPUs and DPUs working together, raises one node's inference performance 10×",
          "A", "10×", not_here=f"{NO_SYSTEM}; the book's machines have no DPU"),
    Entry("none.adaptive-p99-70", "",
          "an adaptive inference engine that picks the best execution path for each input cuts P99 latency 70%",
          "A", "70%", not_here=NO_SYSTEM),
]
