"""GPU checks in one run, for a machine with CUDA (a Colab GPU runtime, or a lent H200):

1. the backend picks torch on CUDA by itself;
2. the torch faces of the kernels agree with the numpy references on the GPU;
3. hardware.measure() on the GPU: copy bandwidth and matmul FLOP/s per dtype;
4. the chapter's kernels on the GPU's roofline, the small GPT on CUDA, and chapter 03's paged
   decode kernel against the copy bandwidth (benchmarks/paged_gpu.py);
5. every chapter and solution notebook runs, cell by cell, on torch/CUDA.

    python benchmarks/gpu_check.py [--json figures.json] [--skip-notebooks] [--only NAME,...] [--notebooks 'ch03*']

Without a GPU it says so, and still runs the notebooks on the CPU (a dry run of the script).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def run_notebook(path: Path) -> dict:
    """Run a notebook's code cells in order in an IPython shell; report failures and the
    check lines it printed."""
    import io
    from contextlib import redirect_stdout

    from IPython.core.interactiveshell import InteractiveShell

    cells = [cell for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "code"]
    shell = InteractiveShell.instance()
    failures, printed = [], io.StringIO()
    started = time.perf_counter()
    for index, cell in enumerate(cells):
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        with redirect_stdout(printed):
            outcome = shell.run_cell(source, store_history=False)
        if not outcome.success:
            error = outcome.error_in_exec or outcome.error_before_exec
            failures.append(f"cell {index}: {type(error).__name__}: {error}")
    lines = printed.getvalue().splitlines()
    return {"cells": len(cells), "failures": failures, "seconds": time.perf_counter() - started,
            "checks": [line for line in lines if line.startswith(("PASS ", "FAIL "))],
            "backend": next((line for line in lines if line.startswith("infra_lab backend:")), None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--skip-notebooks", action="store_true")
    parser.add_argument("--only", help="run only the checks whose names contain one of these, comma-separated")
    parser.add_argument("--notebooks", default="*", help="which notebooks to run, as a glob on the name (default *)")
    parser.add_argument("--notebook", help=argparse.SUPPRESS)  # internal: run one, print JSON
    args = parser.parse_args()
    if args.notebook:
        print("RESULT " + json.dumps(run_notebook(Path(args.notebook))))
        return

    import torch

    from infra_lab import backend, hardware, roofline_kernels, stack
    from infra_lab.kernels import attention_decode, gemv

    figures: dict = {"describe": backend.describe()}
    print(figures["describe"], flush=True)
    on_gpu = torch.cuda.is_available()
    figures["default_backend"] = str(backend.current())

    def step(name, work):
        if args.only and not any(part in name for part in args.only.split(",")):
            return
        started = time.perf_counter()
        try:
            figures[name] = work()
        except Exception:  # one failed check must not hide the others
            figures[name] = {"error": traceback.format_exc(limit=3)}
        print(f"[{time.perf_counter() - started:6.1f} s] {name}: {json.dumps(figures[name], default=str)[:1500]}", flush=True)
        if args.json:  # after every check, so a run stopped at its time limit keeps what it had
            Path(args.json).write_text(json.dumps(figures, indent=1, default=str))

    if on_gpu:
        def agreement():
            rng = np.random.default_rng(0)
            w, x = rng.standard_normal((4096, 3000)).astype(np.float32), rng.standard_normal(3000).astype(np.float32)
            ref = gemv.gemv_numpy(w.astype(np.float64), x.astype(np.float64))
            with backend.using("torch", "cuda"):
                y = gemv.gemv(w, x)
            q = rng.standard_normal((4, 32, 128)).astype(np.float32)
            k, v = (rng.standard_normal((4, 3000, 8, 128)).astype(np.float32) for _ in range(2))
            lengths = np.array([1, 700, 2999, 3000])
            attention_ref = attention_decode.decode_attention_numpy(q, k, v, lengths)
            with backend.using("torch", "cuda"):
                attention = attention_decode.decode_attention(q, k, v, lengths)
            torch.backends.cuda.matmul.allow_tf32 = False
            return {"gemv_max_rel_err": float(np.abs(y - ref).max() / np.abs(ref).max()),
                    "attention_max_abs_err": float(np.abs(attention - attention_ref).max())}

        step("agreement_on_cuda", agreement)

        def measured():
            device = hardware.measure(target="cuda", refresh=True, progress=False)
            return {"name": device.name, "copy_TBps": device.memory_bandwidth / 1e12,
                    "copy_vs_4.3": device.memory_bandwidth / 4.3e12,
                    "TFLOPs": {d: r / 1e12 for d, r in device.peak_flops.items()},
                    "bf16_vs_790": device.peak_flops.get("bf16", 0) / 790e12,
                    "copy_by_size_GBps": [[s, b / 1e9] for s, b in device.probes["copy"]]}

        step("measure_cuda", measured)

        def kernels():
            device = hardware.measure(target="cuda", progress=False)
            return {run.label: {"intensity": run.cost.intensity, "TFLOPs": run.flops_per_s / 1e12,
                                "GBps": run.bytes_per_s / 1e9, "share_of_roof": run.fraction_of_roof(device)}
                    for run in roofline_kernels.run_all("cuda")}

        step("kernels_cuda", kernels)

        def small_gpt():
            from infra_lab import model
            from infra_lab.kernels import attention

            target = model.load("target")
            tokens = np.frombuffer(Path(__file__).read_bytes()[:512], np.uint8).astype(np.int64)
            cpu_logits = target.forward(tokens, backend=backend.resolve("numba"))
            gpu_logits = target.forward(tokens, backend=backend.resolve("torch", "cuda"))
            rng = np.random.default_rng(0)
            q, k, v = (rng.standard_normal((8, 2048, 64)).astype(np.float32) for _ in range(3))
            with backend.using("torch", "cuda"):
                torch.backends.cuda.matmul.allow_tf32 = False
                flash_gpu = attention.attention(q, k, v)
            reference = attention.attention_numpy(q, k, v)
            cpu = model.generate(target, "import os\n", 200, temperature=0, backend=backend.resolve("numba"))
            model.generate(target, "import os\n", 20, temperature=0, backend=backend.resolve("torch", "cuda"))  # warm up
            gpu = model.generate(target, "import os\n", 200, temperature=0, backend=backend.resolve("torch", "cuda"))
            return {"logits_max_abs_diff_cuda_vs_numba": float(np.abs(cpu_logits - gpu_logits).max()),
                    "attention_cuda_max_rel_err": float(np.abs(flash_gpu - reference).max() / np.abs(reference).max()),
                    "greedy_tokens_same_as_cpu": cpu.new_tokens == gpu.new_tokens,
                    "cuda_tokens_per_s": gpu.tokens_per_s, "numba_cpu_tokens_per_s_here": cpu.tokens_per_s}

        step("small_gpt_cuda", small_gpt)

        def paged_cuda():
            sys.path.insert(0, str(ROOT / "benchmarks"))
            import paged_gpu

            return paged_gpu.measure(hardware.measure(target="cuda", progress=False).memory_bandwidth)

        step("paged_decode_cuda", paged_cuda)

        def timeline():
            return {w: stack.idle_fraction(*stack.decode_timeline(w, 8, 10)) for w in (32, 512, 4096)}

        step("idle_fraction_cuda", timeline)
    else:
        figures["note"] = "no CUDA GPU here: only the notebooks ran, on the CPU"

    if not args.skip_notebooks:
        path_list = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        environment = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": path_list}
        pattern = f"{args.notebooks.removesuffix('.ipynb')}.ipynb"
        for path in sorted((ROOT / "book").glob(pattern)) + sorted((ROOT / "solutions").glob(pattern)):
            def one(path=path):
                done = subprocess.run([sys.executable, __file__, "--notebook", str(path)], cwd=path.parent,
                                      env=environment, capture_output=True, text=True, timeout=900)
                result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                return json.loads(result[-1][7:]) if result else {"error": done.stderr[-2000:]}

            step(f"notebook {path.relative_to(ROOT)}", one)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1, default=str))


if __name__ == "__main__":
    main()
