"""A real pretrained model in the book's engine: SmolLM2-135M-Instruct from its GGUF file (Q4_1,
dequantized to float32), against Hugging Face transformers reading the same file, on this CPU.
Sections:

- exact: 20 prompts (code and prose), 64 greedy tokens each, served together by the engine
  (continuous batching, chunked prefill, paged KV) and by transformers' generate one prompt at a
  time: how many prompts agree on every token, and the first disagreement if any.
- decode: batch-1 greedy decode of 64 tokens after a 32-token prompt, tokens/s of the engine
  (numba face: float32, and chapter 08's int8 per channel and int4 in groups of 32, round to
  nearest) and of transformers' generate (float32), the median of rounds; the float32 ones as a
  share of this machine's read bandwidth (numpy, the same run) at the float32 weight bytes a token
  reads. Targets: the engine's float32 at least 0.9x transformers, its int8 at least 1.8x.
- saturation: 64 requests at once with chapter 05's ShareGPT-like lengths (traffic.sharegpt_lengths,
  within 512 tokens; each generates exactly its output length, no end-of-text stop, as vLLM's
  benchmarks do), prompts of held-out standard-library text. Output tokens/s of the engine's
  chunked continuous batching, of its static batching (one batch runs until its longest member
  ends), and of transformers' static batches (left-padded generate; batches of 16 and 64, the
  better one), beside the ceiling E[longest]/E[mean] of the same lengths (traffic.static_ceiling).
  Targets: continuous at least 2x transformers, and at least 2.5x the engine's static batching
  (or below the ceiling, which bounds it).
- memory: the weight bytes by format (as stored in the file, and as float32) and the KV bytes per
  token (2 x layers x KV heads x head size x 4).

    python benchmarks/pretrained.py [--quick] [--only SECTION] [--rounds N] [--json PATH]

Without --quick the figures go to benchmarks/results/pretrained.json. The model's file must be
pulled first (`infra-lab models pull smollm2-135m`).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from infra_lab import backend
from infra_lab.model import corpus, pretrained
from infra_lab.model.quantized import quantize_model
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from engine_core import run_sections, section_parser  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "pretrained.json"
SECTIONS = ("exact", "decode", "saturation", "memory")
NAME = "smollm2-135m"
FULL = {"prompts": 20, "exact_tokens": 64, "decode_prompt": 32, "decode_tokens": 64, "rounds": 5, "requests": 64,
        "hf_batches": (16, 64), "max_len": 512}
QUICK = {"prompts": 3, "exact_tokens": 8, "decode_prompt": 16, "decode_tokens": 8, "rounds": 2, "requests": 8,
         "hf_batches": (4, 8), "max_len": 96}
DECODE_TARGET = 0.9  # the engine's batch-1 decode against transformers' (both float32)
INT8_TARGET = 1.8  # the engine's int8 weights against transformers' float32


def prompts_of(tokenizer, n: int) -> list[list[int]]:
    """n prompts: openings of held-out standard-library modules, and sentences of prose."""
    _, validation = corpus.load()
    text = bytes(validation[:200_000].tolist()).decode("utf-8", "replace")
    code = [text[i * 9000:i * 9000 + 300] for i in range(n // 2)]
    prose = ["The history of the printing press begins", "A good recipe for bread needs",
             "In mathematics, a prime number is", "The capital of Japan is", "Rivers flow to the sea because",
             "My favourite programming language is", "To learn to swim, you should first",
             "The oldest known star map", "When the train left the station,", "Photosynthesis is the process"]
    return [tokenizer.encode(t) for t in (code + prose)[:n]]


def hf_model(path: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def exact(sizes: dict) -> dict:
    model, tokenizer = pretrained.load(NAME)
    reference = hf_model(pretrained.path_of(NAME))
    prompts, k = prompts_of(tokenizer, sizes["prompts"]), sizes["exact_tokens"]
    blocks = sum(-(-(len(p) + k) // 16) for p in prompts) + 8
    config = EngineConfig(policy="chunked", token_budget=128, num_blocks=blocks)
    stops = stop_tokens(reference)
    ours = Engine(model, config, backend.resolve("numba", "cpu")).generate(
        prompts, SamplingParams(max_tokens=k, stop_tokens=stops))
    theirs = []
    for ids in prompts:
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=k, do_sample=False)
        theirs.append(out[0, len(ids):].tolist())
    agree = [a == b for a, b in zip(ours, theirs)]
    first = next(((i, next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
                  for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)  # (prompt, token)
    return {"prompts": len(prompts), "tokens_each": k, "agree": sum(agree), "first_disagreement": first,
            "bar": "every prompt's tokens equal transformers'", "passed": all(agree)}


def stop_tokens(reference) -> tuple[int, ...]:
    """The end-of-text ids transformers' generate stops at, as the engine's stop tokens."""
    eos = reference.generation_config.eos_token_id
    return tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second numpy reads (a sum over a large array), the best of `repeats`."""
    data = np.ones(megabytes * (1 << 20) // 4, np.float32)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.nbytes / best


def decode(sizes: dict, rounds: int) -> dict:
    model, tokenizer = pretrained.load(NAME)
    reference = hf_model(pretrained.path_of(NAME))
    prompt = prompts_of(tokenizer, 1)[0][:sizes["decode_prompt"]]
    k = sizes["decode_tokens"]
    engine = Engine(model, EngineConfig(policy="chunked", num_blocks=16), backend.resolve("numba", "cpu"))
    params = SamplingParams(max_tokens=k, stop_tokens=stop_tokens(reference))
    numba = backend.resolve("numba", "cpu")
    quantized = {f"engine_{name}": Engine(quantize_model(model, "rtn", bits, group),
                                          EngineConfig(policy="chunked", num_blocks=16), numba)
                 for name, bits, group in (("int8", 8, None), ("int4_g32", 4, 32))}

    def ours(on=engine):
        return on.generate([prompt], params)[0]

    def theirs():
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=k, do_sample=False)
        return out[0, len(prompt):].tolist()

    assert ours() == theirs(), "the engine and transformers disagree on the decode prompt"
    runs = {"engine": ours, "transformers": theirs} | {name: (lambda e=e: ours(e)) for name, e in quantized.items()}
    for run in runs.values():
        run()  # warm: the quantized kernels compile on their first call
    seconds, made = {name: [] for name in runs}, {}
    for r in range(rounds):
        for name, run in sorted(runs.items(), reverse=r % 2 == 1):
            started = time.perf_counter()
            made[name] = len(run())  # a quantized model may end its answer sooner
            seconds[name].append(time.perf_counter() - started)
    rate = {name: made[name] / statistics.median(s) for name, s in seconds.items()}
    weight_bytes = 4 * (model.config.total_params + sum(v.size for n, v in model.w.items() if "norm" in n))
    bandwidth = read_bandwidth()
    roof = bandwidth / weight_bytes  # tokens/s if each token read every weight once at that bandwidth
    ratio, int8 = rate["engine"] / rate["transformers"], rate["engine_int8"] / rate["transformers"]
    return {"tokens_per_s": rate, "tokens_made": made, "engine_over_transformers": ratio,
            "int8_over_transformers": int8,
            "int4_g32_over_transformers": rate["engine_int4_g32"] / rate["transformers"],
            "read_GBps": bandwidth / 1e9, "weight_bytes_fp32": weight_bytes, "roof_tokens_per_s": roof,
            "share_of_roof": {name: rate[name] / roof for name in ("engine", "transformers")}, "rounds": rounds,
            "threads": torch.get_num_threads(),
            "bar": f"engine fp32 >= {DECODE_TARGET}x transformers, int8 >= {INT8_TARGET}x (batch 1)",
            "passed": ratio >= DECODE_TARGET and int8 >= INT8_TARGET}


def saturation(sizes: dict) -> dict:
    from infra_lab.serving import traffic

    model, tokenizer = pretrained.load(NAME)
    reference = hf_model(pretrained.path_of(NAME))
    n, max_len = sizes["requests"], sizes["max_len"]
    lengths = traffic.sharegpt_lengths(n, seed=0, max_len=max_len)
    _, validation = corpus.load()
    text = tokenizer.encode(bytes(validation[:400_000].tolist()).decode("utf-8", "replace"))
    starts = np.random.default_rng(1).integers(0, len(text) - max_len, n)
    prompts = [text[s:s + p] for s, (p, _) in zip(starts, lengths)]
    outputs = [o for _, o in lengths]
    useful = sum(outputs)
    numba = backend.resolve("numba", "cpu")
    blocks = sum(-(-(p + o) // 16) for p, o in lengths) + 8

    def engine_run(policy: str) -> float:
        config = EngineConfig(policy=policy, max_batch=n, token_budget=512, num_blocks=blocks)
        engine = Engine(model, config, numba)
        params = [SamplingParams(max_tokens=o) for o in outputs]
        started = time.perf_counter()
        got = engine.generate(prompts, params)
        assert [len(g) for g in got] == outputs
        return time.perf_counter() - started

    def hf_run(batch: int) -> float:
        started = time.perf_counter()
        for first in range(0, n, batch):
            chunk, wanted = prompts[first:first + batch], outputs[first:first + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[2] * (width - len(p)) + p for p in chunk])  # left-padded with the pad token
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            longest = max(wanted)
            with torch.no_grad():  # every member runs until the longest is done: a static batch
                reference.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                   do_sample=False, pad_token_id=2)
        return time.perf_counter() - started

    engine_run("chunked")  # warm
    seconds = {"engine_continuous": engine_run("chunked"), "engine_static": engine_run("static")}
    seconds |= {f"transformers_static_{b}": hf_run(b) for b in sizes["hf_batches"]}
    rate = {name: useful / s for name, s in seconds.items()}
    best_hf = max(v for k, v in rate.items() if k.startswith("transformers"))
    over_hf, over_static = rate["engine_continuous"] / best_hf, rate["engine_continuous"] / rate["engine_static"]
    ceiling = traffic.static_ceiling(outputs, n)
    return {"requests": n, "output_tokens": useful, "mean_prompt": float(np.mean([p for p, _ in lengths])),
            "mean_output": float(np.mean(outputs)), "tokens_per_s": rate, "continuous_over_transformers": over_hf,
            "continuous_over_static": over_static, "static_ceiling": ceiling,
            "bar": "continuous >= 2x transformers' best static batch, and >= 2.5x static (or the ceiling)",
            "passed": over_hf >= 2 and over_static >= min(2.5, ceiling)}


def memory(_sizes: dict) -> dict:
    from infra_lab.model import gguf_file

    read = gguf_file.read(pretrained.path_of(NAME))
    c = read.config
    stored = {}
    import gguf

    for tensor in gguf.GGUFReader(read.path).tensors:
        stored[tensor.tensor_type.name] = stored.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    return {"file_bytes_by_format": stored, "float32_weight_bytes": sum(w.nbytes for w in read.weights.values()),
            "parameters": c.total_params, "kv_bytes_per_token_fp32": 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4}


def headline(name: str, f: dict) -> str:
    if name == "exact":
        return f"{f['agree']} of {f['prompts']} prompts agree on all {f['tokens_each']} tokens"
    if name == "decode":
        rate = f["tokens_per_s"]
        return (f"engine {rate['engine']:.1f} tokens/s (int8 {rate['engine_int8']:.1f}, int4 "
                f"{rate['engine_int4_g32']:.1f}), transformers {rate['transformers']:.1f} "
                f"({f['engine_over_transformers']:.2f}x, int8 {f['int8_over_transformers']:.2f}x; {f['bar']}: "
                f"{'met' if f['passed'] else 'missed'}); "
                f"roof {f['roof_tokens_per_s']:.1f} at "
                f"{f['read_GBps']:.1f} GB/s")
    if name == "saturation":
        rates = ", ".join(f"{k} {v:,.0f}" for k, v in f["tokens_per_s"].items())
        return (f"tokens/s: {rates}; continuous {f['continuous_over_transformers']:.2f}x transformers, "
                f"{f['continuous_over_static']:.2f}x static (ceiling {f['static_ceiling']:.2f}) "
                f"({'met' if f['passed'] else 'missed'})")
    return f"{f['float32_weight_bytes'] / 1e6:.0f} MB float32, {f['kv_bytes_per_token_fp32']:,} KV bytes a token"


def main() -> None:
    parser = section_parser(__doc__, SECTIONS, RESULTS)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    rounds = args.rounds or sizes["rounds"]
    pretrained.pull(NAME, quiet=True)
    run_sections("benchmarks/pretrained.py", SECTIONS,
                 {"exact": lambda _: exact(sizes), "decode": lambda _: decode(sizes, rounds),
                  "saturation": lambda _: saturation(sizes),
                  "memory": lambda _: memory(sizes)},
                 args, headline, RESULTS, {"quick": args.quick, "sizes": sizes})


if __name__ == "__main__":
    main()
