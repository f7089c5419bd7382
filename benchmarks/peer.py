"""A peer of the book's engine, in a process of its own and timed there: Hugging Face transformers
or llama.cpp reading the same GGUF file, as their users run them, with their libraries' own
threading. Nothing of infra_lab is imported here: infra_lab tells OpenMP to let idle threads sleep
(OMP_WAIT_POLICY=PASSIVE), which suits numba's kernels but cost llama.cpp, which waits at an
OpenMP barrier after every operation, 3x on a 2-core EPYC (about 30 against 93 tokens/s).
benchmarks/pretrained.py starts it (Peer) with that variable taken out of the environment.

    python benchmarks/peer.py llama|transformers GGUF_PATH THREADS CONTEXT

Requests are JSON lines on stdin, answers JSON lines on stdout:
{"prompts": [[id, ...], ...], "tokens": [k, ...]} -> {"made": [[id, ...], ...], "seconds": s}.
llama.cpp serves the prompts one after another (its one stream), its cache emptied before each;
transformers serves them as one static batch, left-padded, every member generating until the
longest is done (greedy, no end-of-text stop: exactly k tokens each).
"""
from __future__ import annotations

import json
import sys
import time


def llama(path: str, threads: int, context: int):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=context, n_batch=512, n_threads=threads, verbose=False)

    def serve(prompts: list[list[int]], tokens: list[int]) -> list[list[int]]:
        made = []
        for prompt, k in zip(prompts, tokens):
            llm.reset()  # no prefix reuse between requests
            out = []
            for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=False):
                out.append(int(token))
                if len(out) == k:
                    break
            made.append(out)
        return made
    return serve


def transformers_(path: str, threads: int, _context: int):
    from pathlib import Path

    import torch
    import transformers

    torch.set_num_threads(threads)
    file = Path(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                              dtype=torch.float32).eval()
    pad = 2  # SmolLM2's padding token, as its tokenizer names it

    def serve(prompts: list[list[int]], tokens: list[int]) -> list[list[int]]:
        width, longest = max(len(p) for p in prompts), max(tokens)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                 do_sample=False, pad_token_id=pad)
        return [row[width:width + k].tolist() for row, k in zip(out, tokens)]
    return serve


def main() -> None:
    kind, path, threads, context = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    serve = {"llama": llama, "transformers": transformers_}[kind](path, threads, context)
    print(json.dumps({"ready": kind}), flush=True)
    for line in sys.stdin:
        asked = json.loads(line)
        started = time.perf_counter()
        made = serve(asked["prompts"], asked["tokens"])
        print(json.dumps({"made": made, "seconds": time.perf_counter() - started}), flush=True)


if __name__ == "__main__":
    main()
