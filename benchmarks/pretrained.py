"""A real pretrained model in the book's engine: SmolLM2-135M-Instruct from its GGUF file (Q4_1,
dequantized to float32), against Hugging Face transformers reading the same file, on this CPU.
Sections:

- exact: 20 prompts (code and prose), 64 greedy tokens each, served together by the engine
  (continuous batching, chunked prefill, paged KV) and by transformers' generate one prompt at a
  time: how many prompts agree on every token, and the first disagreement if any.
- decode: batch-1 greedy decode of 64 tokens after a 32-token prompt (no end-of-text stop, so every
  variant makes all 64), tokens/s of the engine (numba face: float32, and chapter 08's int8 per
  channel and int4 in groups of 32, round to nearest, each with an int8 LM head as the file's Q8_0
  table), of transformers' generate (float32) and of llama.cpp (llama-cpp-python, the same file,
  built from source here on first use: llama_cpp_module), both in processes of their own as their
  users run them (benchmarks/peer.py, which times them there), the median of 11 rounds in turns, each
  ratio the median of the rounds' own ratios with its 95% interval; each rate as a share of this
  machine's read bandwidth (numpy, the same run) at the weight bytes a token reads.
  Targets: the engine's float32 at least 0.9x transformers, its int8 at least 1.8x, its int4 at
  least 0.7x llama.cpp.
- saturation: 64 requests at once with chapter 05's ShareGPT-like lengths (traffic.sharegpt_lengths,
  within 512 tokens; each generates exactly its output length, no end-of-text stop, as vLLM's
  benchmarks do), prompts of held-out standard-library text. Output tokens/s of the engine's
  chunked continuous batching (max_batch 64), of transformers' static batches of 16 (left-padded
  generate; a batch of 64 did worse here, 24 against 37 tokens/s on 2026-12-06, and takes 7
  minutes) and of llama.cpp's one stream (the requests one after another). Targets: at least 2x
  transformers and at least 3x llama.cpp. Continuous against static batching on this model is
  benchmarks/serving.py's weight_bound section, at a batch whose step still reads weights.
- memory: the weight bytes by format in the file; the arithmetic (float32 weights, KV bytes a token,
  2 x layers x KV heads x head size x 4, and a pool of 1,024 blocks); and, each in a fresh process,
  the resident memory the float32 and the int4 model take, and an engine with that pool.

    python benchmarks/pretrained.py [--quick] [--only SECTION] [--rounds N] [--json PATH]

Without --quick the figures go to benchmarks/results/pretrained.json. The model's file must be
pulled first (`infra-lab models pull smollm2-135m`).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import infra_lab  # noqa: F401  (before torch: its OpenMP threads then sleep between kernels, and numba keeps OpenMP)
import numpy as np
import torch

from infra_lab import backend
from infra_lab.model import corpus, pretrained
from infra_lab.model.quantized import quantize_model
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.engine import Engine
from infra_lab.serving.request import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from engine_core import median_interval, run_sections, section_parser  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "pretrained.json"
SECTIONS = ("exact", "decode", "saturation", "memory")
NAME = "smollm2-135m"
FULL = {"prompts": 20, "exact_tokens": 64, "decode_prompt": 32, "decode_tokens": 64, "rounds": 11, "requests": 64,
        "hf_batches": (16,), "max_len": 512}
QUICK = {"prompts": 3, "exact_tokens": 8, "decode_prompt": 16, "decode_tokens": 8, "rounds": 2, "requests": 8,
         "hf_batches": (4, 8), "max_len": 96}
DECODE_TARGET = 0.9  # the engine's batch-1 decode against transformers' (both float32)
INT8_TARGET = 1.8  # the engine's int8 weights against transformers' float32
INT4_TARGET = 0.7  # the engine's int4 weights against llama.cpp reading the file's Q4_1


def ratio_figures(per_round: list[float]) -> dict:
    """A ratio's median over rounds, with a 95% interval for that median (order statistics)."""
    return {"median": statistics.median(per_round), "interval_95": median_interval(per_round), "per_round": per_round}


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


LLAMA_CPP = "llama-cpp-python==0.3.36"
# llama.cpp's CMake options for the vector extensions this CPU has (LLVM reads them), named one by
# one rather than through its default -DGGML_NATIVE=ON: built natively it crashed with a
# segmentation fault at its first evaluation on a 2-core VM whose CPU reports AMX.
LLAMA_CPP_FEATURES = {"avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avx512f": "AVX512",
                      "avx512vnni": "AVX512_VNNI", "avx512vbmi": "AVX512_VBMI", "avx512bf16": "AVX512_BF16"}


def llama_cpp_cmake_args() -> str:
    import llvmlite.binding as llvm

    features = llvm.get_host_cpu_features()
    return " ".join(["-DGGML_NATIVE=OFF"] + [f"-DGGML_{flag}=ON" for feature, flag in LLAMA_CPP_FEATURES.items()
                                              if features.get(feature)])


def llama_cpp_module():
    """llama-cpp-python, built from source into this environment on first use (about 4 minutes
    on 2 cores, with llama_cpp_cmake_args), so that the benchmark needs nothing installed by hand."""
    try:
        import llama_cpp
    except ImportError:
        cmake = llama_cpp_cmake_args()
        print(f"building {LLAMA_CPP} from source (CMAKE_ARGS={cmake!r}) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-binary", "llama-cpp-python", LLAMA_CPP],
                       env=os.environ | {"CMAKE_ARGS": cmake}, check=True)
        import llama_cpp
    return llama_cpp


class Peer:
    """transformers or llama.cpp in a process of its own (benchmarks/peer.py), as its users run it:
    the environment without the OpenMP setting infra_lab makes for numba's kernels."""

    def __init__(self, kind: str, context: int):
        if kind == "llama":
            llama_cpp_module()  # built here first, if it must be
        environment = dict(os.environ)
        if infra_lab._OPENMP_POLICY_AT_IMPORT is None:  # infra_lab's, not the user's
            environment.pop("OMP_WAIT_POLICY", None)
        for name in ("NUMBA_THREADING_LAYER", "NUMBA_CPU_FEATURES"):
            environment.pop(name, None)
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "peer.py"), kind, str(pretrained.path_of(NAME)),
             str(torch.get_num_threads()), str(context)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=environment)
        ready = self.process.stdout.readline()
        if not ready:
            raise RuntimeError(f"the {kind} peer did not start (its error is above)")

    def serve(self, prompts: list[list[int]], tokens: list[int]) -> tuple[list[list[int]], float]:
        """The peer's tokens for `prompts`, exactly tokens[i] each, and the seconds it took (timed there)."""
        self.process.stdin.write(json.dumps({"prompts": prompts, "tokens": tokens}) + "\n")
        self.process.stdin.flush()
        answer = json.loads(self.process.stdout.readline())
        return answer["made"], answer["seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(60)


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second numpy reads (a sum over a large array), the best of `repeats`."""
    data = np.ones(megabytes * (1 << 20) // 4, np.float32)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.nbytes / best


def bytes_per_token(model) -> int:
    """The weight bytes one decoded token reads: every matrix as the kernels read it (float32, or
    quantized codes with their float32 scales), the norms, and one row of the embedding table."""
    c = model.config
    quantized = getattr(model, "quantized", {})
    # total_params counts a tied table once, as the head; an untied table is only indexed
    floats = c.total_params - sum(m.n_in * m.n_out for m in quantized.values()) - (
        0 if c.tied_embeddings else c.vocab * c.d_model)
    norms = sum(model.w[name].size for name in model.w if "norm" in name)
    return sum(m.nbytes for m in quantized.values()) + 4 * (floats + norms + c.d_model)


def file_tensor_bytes() -> int:
    """The tensors' bytes in the GGUF file: what llama.cpp reads a token (its head is the Q8_0
    embedding table)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(pretrained.path_of(NAME)).tensors)


QUANTIZED = (("int8", 8, None), ("int4_g32", 4, 32))  # (name, bits, group): round to nearest, head int8


def decode(sizes: dict, rounds: int) -> dict:
    model, tokenizer = pretrained.load(NAME)
    reference = hf_model(pretrained.path_of(NAME))
    prompt = prompts_of(tokenizer, 2)[0][:sizes["decode_prompt"]]  # the opening of a held-out module
    assert len(prompt) == sizes["decode_prompt"], len(prompt)
    k = sizes["decode_tokens"]
    numba = backend.resolve("numba", "cpu")
    config = EngineConfig(policy="chunked", num_blocks=16)
    engines = {"engine": Engine(model, config, numba)} | {
        f"engine_{name}": Engine(quantize_model(model, "rtn", bits, group, head_bits=8), config, numba)
        for name, bits, group in QUANTIZED}
    exactly_k = SamplingParams(max_tokens=k)  # no end-of-text stop: every variant makes k tokens
    with torch.no_grad():  # the exactness check, in this process
        said = reference.generate(torch.tensor([prompt]), max_new_tokens=k, do_sample=False)[0, len(prompt):]
    said = said.tolist()
    greedy = engines["engine"].generate([prompt], SamplingParams(max_tokens=k, stop_tokens=stop_tokens(reference)))
    assert greedy[0] == said, "the engine and transformers disagree on the decode prompt"
    del reference
    peers = {name: Peer(kind, 2 * (len(prompt) + k)) for name, kind in (("transformers", "transformers"),
                                                                          ("llama_cpp", "llama"))}

    def timed_engine(engine: Engine) -> tuple[list[int], float]:
        started = time.perf_counter()
        made = engine.generate([prompt], exactly_k)[0]
        return made, time.perf_counter() - started

    def timed_peer(peer: Peer) -> tuple[list[int], float]:
        made, seconds = peer.serve([prompt], [k])
        return made[0], seconds

    runs = {name: (lambda e=e: timed_engine(e)) for name, e in engines.items()}
    runs |= {name: (lambda p=p: timed_peer(p)) for name, p in peers.items()}
    made = {name: run()[0] for name, run in runs.items()}  # warm: the quantized kernels compile on their first call
    assert all(len(m) == k for m in made.values()), {name: len(m) for name, m in made.items()}
    seconds = {name: [] for name in runs}
    for r in range(rounds):  # the variants take turns, in the opposite order every other round
        for name, run in sorted(runs.items(), reverse=r % 2 == 1):
            seconds[name].append(run()[1])  # a peer times itself, in its process
    for peer in peers.values():
        peer.close()
    rate = {name: k / statistics.median(s) for name, s in seconds.items()}
    reads = {name: bytes_per_token(e.runner.model) for name, e in engines.items()}
    reads |= {"transformers": reads["engine"], "llama_cpp": file_tensor_bytes()}
    bandwidth = read_bandwidth()
    pairs = {"fp32_over_transformers": ("engine", "transformers"),
             "int8_over_transformers": ("engine_int8", "transformers"),
             "int4_g32_over_llama_cpp": ("engine_int4_g32", "llama_cpp")}
    ratios = {name: ratio_figures([b / a for a, b in zip(seconds[ours], seconds[peer])])  # each round's own ratio
              for name, (ours, peer) in pairs.items()}
    over = {name: figure["median"] for name, figure in ratios.items()}
    agree = {name: next((i for i, (a, b) in enumerate(zip(m, made["engine"])) if a != b), k)
             for name, m in made.items()}  # leading tokens equal to the engine's float32 ones
    return {"tokens_per_s": rate, "ratios": over, "ratio_intervals": ratios, "bytes_per_token": reads,
            "read_GBps": bandwidth / 1e9,
            "share_of_read_bandwidth": {name: rate[name] * reads[name] / bandwidth for name in runs},
            "leading_tokens_equal_to_fp32": agree, "prompt_tokens": len(prompt), "tokens": k, "rounds": rounds,
            "threads": torch.get_num_threads(),
            "bar": f"engine fp32 >= {DECODE_TARGET}x transformers, int8 >= {INT8_TARGET}x transformers, "
                   f"int4 >= {INT4_TARGET}x llama.cpp (batch 1)",
            "passed": over["fp32_over_transformers"] >= DECODE_TARGET and over["int8_over_transformers"] >= INT8_TARGET
            and over["int4_g32_over_llama_cpp"] >= INT4_TARGET}


def saturation(sizes: dict) -> dict:
    from infra_lab.serving import traffic

    model, tokenizer = pretrained.load(NAME)
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

    def engine_run(requests: int = n) -> float:
        config = EngineConfig(policy="chunked", max_batch=n, token_budget=512, num_blocks=blocks)
        engine = Engine(model, config, numba)
        params = [SamplingParams(max_tokens=o) for o in outputs[:requests]]
        started = time.perf_counter()
        got = engine.generate(prompts[:requests], params)
        assert [len(g) for g in got] == outputs[:requests]
        return time.perf_counter() - started

    def peer_run(peer: Peer, batch: int) -> float:  # transformers: static batches; llama.cpp: one stream
        peer.serve(prompts[:1], [2])  # warm
        seconds = 0.0
        for first in range(0, n, batch):
            made, took = peer.serve(prompts[first:first + batch], outputs[first:first + batch])
            assert [len(m) for m in made] == outputs[first:first + batch]
            seconds += took
        peer.close()
        return seconds

    engine_run(2)  # warm: compile the kernels
    seconds = {"engine_continuous": engine_run()}
    seconds |= {f"transformers_static_{b}": peer_run(Peer("transformers", max_len + 16), b)
                for b in sizes["hf_batches"]}
    seconds["llama_cpp_one_stream"] = peer_run(Peer("llama", max_len + 16), n)
    rate = {name: useful / s for name, s in seconds.items()}
    best_hf = max(v for k, v in rate.items() if k.startswith("transformers"))
    over_hf, over_llama = rate["engine_continuous"] / best_hf, rate["engine_continuous"] / rate["llama_cpp_one_stream"]
    roof = compute_roof(model.config, lengths)
    return {"requests": n, "output_tokens": useful, "mean_prompt": float(np.mean([p for p, _ in lengths])),
            "mean_output": float(np.mean(outputs)), "max_batch": n, "tokens_per_s": rate,
            "compute_roof": roof | {
                "engine_share": rate["engine_continuous"] / roof["tokens_per_s"],
                "share_3x_llama_cpp_needs": 3 * rate["llama_cpp_one_stream"] / roof["tokens_per_s"]},
            "continuous_over_transformers": over_hf, "continuous_over_llama_cpp": over_llama,
            "static_ceiling": traffic.static_ceiling(outputs, n),
            "bar": "the engine's continuous batching >= 2x transformers' best static batch and >= 3x llama.cpp's "
                   "one stream",
            "passed": over_hf >= 2 and over_llama >= 3}


def compute_roof(config, lengths: list[tuple[int, int]]) -> dict:
    """The output tokens/s this CPU's float32 matmul peak (hardware.measure) allows for these
    requests, their prefills and every decode step's attention counted (model.cost): at 64 requests
    a step is bound by arithmetic here, not by the weights it reads."""
    from infra_lab import hardware
    from infra_lab.model import cost

    flops = 0.0
    for prompt, output in lengths:  # the prompt's prefill, then one token at each context
        flops += cost.step_cost(config, 1, prompt, 0, "fp32").flops
        flops += sum(cost.step_cost(config, 1, 1, prompt + t, "fp32").flops for t in range(output - 1))
    peak = hardware.measure("cpu", progress=False).flops("fp32")
    return {"flops": flops, "cpu_fp32_flops_per_s": peak, "tokens_per_s": sum(o for _, o in lengths) * peak / flops}


def resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def resident_probe(kind: str) -> dict:
    """In a fresh process (Linux, glibc): resident bytes after the imports, after loading the
    model (float32, or chapter 08's int4 g32 with an int8 head, the float32 model then freed), and
    after an engine with a pool of POOL_BLOCKS KV blocks has served one request (its pool touched
    throughout, as a full one would be)."""
    import ctypes
    import gc

    base = resident_bytes()
    model, tokenizer = pretrained.load(NAME)
    if kind == "int4_g32":
        model = quantize_model(model, "rtn", 4, 32, head_bits=8)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand back what the loading freed, which glibc may keep
    loaded = resident_bytes()
    engine = Engine(model, EngineConfig(num_blocks=POOL_BLOCKS), backend.resolve("numba", "cpu"))
    engine.runner.pool.kv[...] = 0  # touch every page of the pool, as a full pool would
    engine.generate([tokenizer.encode("The capital of France is")], SamplingParams(max_tokens=4))
    return {"imports": base, "model": loaded - base, "engine_and_pool": resident_bytes() - loaded,
            "pool_bytes": int(engine.runner.pool.kv.nbytes), "weights_held": weights_held(engine.runner.model)}


def weights_held(model) -> int:
    """Bytes of the distinct arrays the model holds (a view counted with its base): its float
    weights and fused matrices, and quantized codes with their scales."""
    floats = getattr(model.w, "floats", model.w)  # a quantized model's float weights (DequantizedWeights)
    roots = {}
    for array in [*floats.values(), *model.matrices.values()]:
        while isinstance(array.base, np.ndarray):
            array = array.base
        roots[id(array)] = array.nbytes
    return sum(roots.values()) + sum(m.nbytes for m in getattr(model, "quantized", {}).values())


POOL_BLOCKS = 1024  # 16,384 tokens of KV


def memory(_sizes: dict) -> dict:
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    import gguf

    config = pretrained.load(NAME)[0].config
    stored = {}
    for tensor in gguf.GGUFReader(pretrained.path_of(NAME)).tensors:
        stored[tensor.tensor_type.name] = stored.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    resident = {}
    for kind in ("fp32", "int4_g32"):  # each in a fresh process, so that one's arrays do not hide the other's
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            resident[kind] = pool.submit(resident_probe, kind).result()
    kv_token = 2 * config.n_layers * config.n_kv_heads * config.head_dim * 4
    return {"file_bytes_by_format": stored, "parameters": config.total_params,
            "arithmetic": {"fp32_weight_bytes": 4 * config.total_params,
                           "kv_bytes_per_token_fp32": kv_token, "pool_bytes": POOL_BLOCKS * 16 * kv_token},
            "resident": resident, "pool_blocks": POOL_BLOCKS}


def headline(name: str, f: dict) -> str:
    if name == "exact":
        return f"{f['agree']} of {f['prompts']} prompts agree on all {f['tokens_each']} tokens"
    if name == "decode":
        rates = ", ".join(f"{k} {v:.1f} ({f['share_of_read_bandwidth'][k]:.0%})" for k, v in f["tokens_per_s"].items())
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in f["ratios"].items())
        return (f"tokens/s (share of {f['read_GBps']:.1f} GB/s): {rates}; {ratios} "
                f"({'met' if f['passed'] else 'missed'})")
    if name == "saturation":
        rates = ", ".join(f"{k} {v:,.0f}" for k, v in f["tokens_per_s"].items())
        return (f"tokens/s: {rates}; continuous {f['continuous_over_transformers']:.2f}x transformers, "
                f"{f['continuous_over_llama_cpp']:.2f}x llama.cpp ({'met' if f['passed'] else 'missed'}); compute roof "
                f"{f['compute_roof']['tokens_per_s']:,.0f} (engine {f['compute_roof']['engine_share']:.0%}; "
                f"3x llama.cpp needs {f['compute_roof']['share_3x_llama_cpp_needs']:.0%})")
    resident = ", ".join(f"{k}: model {v['model'] / 1e6:.0f} MB, engine {v['engine_and_pool'] / 1e6:.0f} MB"
                         for k, v in f["resident"].items())
    return (f"{f['arithmetic']['fp32_weight_bytes'] / 1e6:.0f} MB float32 by arithmetic, "
            f"{f['arithmetic']['kv_bytes_per_token_fp32']:,} KV bytes a token; resident {resident}")


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
