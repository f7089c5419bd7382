"""Issue 18's balance bar: the MoE model trained once per balancing method, same seed and
schedule: no balancing; Switch's aux loss with ST-MoE's z-loss, at Switch's weight 0.01 and at 0.1;
DeepSeek-V3's bias, moved by gamma 0.001 from each step's loads (the shipped model); and two
variants of the bias: gamma 10x faster, and loads counted over the last 16 steps. For each run:
the training steps' expert loads every 50 steps, validation bits per byte, and each layer's load
per expert over the whole validation split, read back from the saved fp16 weights. About 15 to 20 minutes per run on
2 cores; results/moe_balancing.json gets each run as it ends (runs not asked for are kept).

    python benchmarks/moe_balancing.py [--steps N] [--runs LABEL ...] [--no-ship]
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from infra_lab import backend
from infra_lab.model import corpus, train, weights
from infra_lab.model.torch_model import TorchTransformer

RESULTS = Path(__file__).parent / "results" / "moe_balancing.json"
RUNS = {  # label: the balancing, and for the bias its rate gamma and the steps its loads are counted over
    "none": {"balancing": "none"},
    "aux": {"balancing": "aux"},  # Switch's alpha, 0.01
    "aux, 10x weight": {"balancing": "aux", "aux_weight": 0.1},
    "bias": {"balancing": "bias", "bias_rate": train.BIAS_RATE, "bias_window": train.BIAS_WINDOW},
    "bias, 10x faster": {"balancing": "bias", "bias_rate": 0.01, "bias_window": 1},
    "bias, 16-step loads": {"balancing": "bias", "bias_rate": 0.001, "bias_window": 16},
}
SHIPPED = "bias"


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--steps", type=int, help="optimizer steps (default: the shipped schedule)")
    options.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    options.add_argument("--no-ship", action="store_true", help="leave the shipped weights alone")
    options.add_argument("--json", type=Path, default=RESULTS)
    args = options.parse_args()
    results = json.loads(args.json.read_text()) if args.json.is_file() else {"runs": {}}
    results |= {"machine": f"{backend.cpu_model()}, {torch.get_num_threads()} threads",
                "measured_on": time.strftime("%Y-%m-%d"), "command": "python benchmarks/moe_balancing.py"}
    _, validation = corpus.load()
    folder = Path(tempfile.mkdtemp())
    for label in args.runs:
        out = folder / "moe.npz"
        figures = train.train("moe", out, steps=args.steps, progress=False, **RUNS[label])
        loaded, config, _ = weights.load(out)
        shares = train.expert_loads(TorchTransformer(config, loaded), validation)  # (layers, experts)
        figures["validation_loads_fp16"] = shares.tolist()
        figures["max_over_mean_per_layer"] = (shares.max(1) * shares.shape[1]).tolist()
        results["runs"][label] = figures
        print(label, f"{figures['validation_bits_per_byte']:.3f} bits/byte,",
              "max/mean per layer", np.round(figures["max_over_mean_per_layer"], 3))
        args.json.write_text(json.dumps(results, indent=1) + "\n")
        if label == SHIPPED and not args.no_ship and args.steps is None:
            shutil.copy(out, weights.path_for("moe"))


if __name__ == "__main__":
    main()
