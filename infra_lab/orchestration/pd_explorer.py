"""The explorer's grid for prefill/decode placement (chapter 06): goodput per GPU over model x GPU
x SLO scale x prefill:decode ratio, precomputed as plain JSON-able dicts for the benchmark to store.

For each model and GPU, instances use the smallest tensor-parallel degree the model fits at; for
each SLO scale (DistServe's Figure 1 objectives, TTFT 0.4 s and TPOT 0.04 s, times the scale),
each phase's goodput per instance is simulated alone (serving.goodput), and a ratio of P prefill
to D decode instances serves min(P x prefill, D x decode) requests per second, as DistServe's
Algorithm 1 composes them; the colocated goodput of one instance is simulated beside it.
"""
from __future__ import annotations

import time

from infra_lab import hardware
from infra_lab.orchestration.pd_claims import FIGURE1_LENGTHS, FIGURE1_MBU, FIGURE1_MFU, FIGURE1_SLO
from infra_lab.progress import bar
from infra_lab.roofline import preset
from infra_lab.serving.goodput import Bisection, decode_goodput, goodput, prefill_goodput
from infra_lab.serving.pd_fleet import Colocated, Instances, Serving
from infra_lab.serving.placement import fits

RATIOS = ((1, 4), (1, 3), (1, 2), (2, 3), (1, 1), (3, 2), (2, 1), (3, 1), (4, 1))
SIZES = {  # what each size covers, and how finely it searches each goodput
    "tiny": {"models": ("opt-13b",), "devices": ("A100 SXM 80GB",), "slo_scales": (1.0,),
             "ratios": ((1, 1), (2, 1)), "bisection": Bisection(n=60, rel_tol=0.1, max_runs=6)},
    "small": {"models": ("opt-13b", "llama-3-8b"), "devices": ("A100 SXM 80GB", "H100 SXM"),
              "slo_scales": (0.5, 1.0, 2.0), "ratios": ((1, 2), (1, 1), (2, 1), (3, 1)),
              "bisection": Bisection(n=150, rel_tol=0.05, max_runs=8)},
    "full": {"models": ("opt-13b", "opt-66b", "llama-3-8b", "llama-3-70b"),
             "devices": ("A100 SXM 80GB", "H100 SXM", "H200"), "slo_scales": (0.5, 0.75, 1.0, 1.5, 2.0),
             "ratios": RATIOS, "bisection": Bisection(n=200, rel_tol=0.03, max_runs=10)},
}


def smallest_tp(serving: Serving, device, degrees: tuple[int, ...] = (1, 2, 4, 8)) -> int:
    for tp in degrees:
        if fits(serving, device, tp):
            return tp
    raise ValueError(f"{serving.model.name} fits on no degree in {degrees} of {device.name}")


def explorer_grid(size: str = "small", mfu: float = FIGURE1_MFU, mbu: float = FIGURE1_MBU, lengths=FIGURE1_LENGTHS,
                  base_slo=FIGURE1_SLO, progress: bool = True) -> dict:
    """{"settings": ..., "rows": one dict per model, GPU, SLO scale and prefill:decode ratio}: each
    row's disaggregated and colocated goodput per GPU (req/s), their ratio, and the phases'
    goodputs per instance. `size` is one of SIZES; "full" takes tens of minutes."""
    if size not in SIZES:
        raise KeyError(f"unknown size {size!r}; sizes: {', '.join(SIZES)}")
    spec, started, rows = SIZES[size], time.perf_counter(), []
    cells = [(m, d, s) for m in spec["models"] for d in spec["devices"] for s in spec["slo_scales"]]
    bisection = spec["bisection"]
    for model, device_name, scale in bar(cells, show=progress, desc="placement grid"):
        serving = Serving(preset(model), "fp16", compute_efficiency=mfu, memory_efficiency=mbu)
        device, slo = hardware.get(device_name), base_slo.scaled(scale)
        tp = smallest_tp(serving, device)
        one = Instances(1, device, tp)
        prefill = prefill_goodput(one, serving, lengths, slo.ttft_s, bisection).rate_req_s
        decode = decode_goodput(one, serving, lengths, slo.tpot_s, bisection).rate_req_s
        colocated = goodput(Colocated(one), serving, lengths, slo, bisection).per_gpu
        for prefill_count, decode_count in spec["ratios"]:
            per_gpu = min(prefill_count * prefill, decode_count * decode) / ((prefill_count + decode_count) * tp)
            rows.append({"model": model, "device": device_name, "tp": tp, "slo_scale": scale,
                         "ttft_slo_s": slo.ttft_s, "tpot_slo_s": slo.tpot_s,
                         "prefill_decode": f"{prefill_count}:{decode_count}", "prefill_instances": prefill_count,
                         "decode_instances": decode_count, "prefill_goodput": prefill, "decode_goodput": decode,
                         "disaggregated_per_gpu": per_gpu, "colocated_per_gpu": colocated,
                         "gain": per_gpu / colocated if colocated > 0 else None})
    return {"settings": {"size": size, "lengths": lengths.label, "base_ttft_slo_s": base_slo.ttft_s,
                         "base_tpot_slo_s": base_slo.tpot_s, "mfu": mfu, "mbu": mbu, "requests_per_rate": bisection.n,
                         "attainment": bisection.target},
            "rows": rows, "seconds": time.perf_counter() - started}
