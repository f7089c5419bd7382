"""The arguments of `infra-lab serve`, `infra-lab bench serve` and `infra-lab route`.

Declared here, apart from the modules that run them, so that `infra-lab --help` stays fast: the
server, the router and the load generator import FastAPI, uvicorn and httpx only when they run.
The names follow vLLM's (`vllm serve`, `vllm bench serve`) where it has one.
"""
from __future__ import annotations

import argparse


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1; got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 requests per second, or inf; got {text}")
    return value


def add_serve(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="target",
                        help="the book's models by name (target, draft), a pretrained one (smollm2-135m), "
                             "or a weights file (.npz of the book's models, or a llama .gguf)")
    parser.add_argument("--served-model-name", help="the name clients ask for (default: --model)")
    parser.add_argument("--weight-version", type=int, default=0,
                        help="the version the weights start as (each response's system_fingerprint names it)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed at start)")
    parser.add_argument("--policy", default="chunked", help="the engine's batching policy (EngineConfig.policy)")
    parser.add_argument("--max-batch", type=_positive_int, default=32, help="requests running at once")
    parser.add_argument("--token-budget", type=_positive_int, default=512, help="tokens computed per step")
    parser.add_argument("--num-blocks", type=_positive_int, default=1024, help="KV blocks in the pool")
    parser.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")
    parser.add_argument("--prefix-cache", choices=["none", "radix", "hash"], default="none",
                        help="the prefix cache: radix (chapter 04, block size 1) or hash (chapter 03)")
    parser.add_argument("--max-queue", type=_positive_int, default=256,
                        help="requests that may wait for their first step; more get 429 with Retry-After")
    parser.add_argument("--max-n", type=_positive_int, default=16, help="most samples one request may ask for")
    parser.add_argument("--threads", type=_positive_int, help="CPU threads for the kernels (default: all)")
    parser.add_argument("--blas-threads", type=_positive_int, default=1,
                        help="threads for numpy's BLAS (1: they would spin on the cores numba's kernels need)")
    parser.add_argument("--backend", help="numpy, numba or torch (default: the best this machine has)")
    parser.add_argument("--admin-key", help="the key POST /admin/weights demands (none: hot reload is off)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds SIGTERM waits for requests in flight before aborting them")
    pd = parser.add_argument_group("disaggregated prefill and decode (chapter 06)")
    pd.add_argument("--kv-role", choices=["prefill", "decode"],
                    help="prefill: compute prompts and send their K and V; decode: take them and generate")
    pd.add_argument("--kv-transport", choices=["gloo", "shm"], default="gloo",
                    help="torch.distributed over gloo (TCP), or shared memory on this machine")
    pd.add_argument("--kv-rank", type=int, help="gloo: this worker's rank in the deployment")
    pd.add_argument("--kv-world", type=_positive_int, help="gloo: how many prefill and decode workers in all")
    pd.add_argument("--kv-master", help="gloo: HOST:PORT of the store rank 0 hosts")
    pd.add_argument("--kv-timeout", type=float, default=30.0,
                    help="seconds a transfer may take, sent or awaited, before it fails by name")


def add_bench_serve(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the model name the server serves")
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--workload", default="sharegpt", choices=["sharegpt", "shared-prefix"],
                        help="chapter 05's ShareGPT-like lengths, or prompts that share a few long openings")
    parser.add_argument("--num-prompts", type=_positive_int, default=100)
    parser.add_argument("--num-prefixes", type=_positive_int, default=3,
                        help="shared-prefix: how many openings the prompts share")
    parser.add_argument("--request-rate", type=_rate, default=float("inf"),
                        help="requests per second (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="the gamma arrivals' shape: 1 is Poisson, below 1 burstier, above 1 steadier")
    parser.add_argument("--max-concurrency", type=_positive_int, help="most requests in flight at once")
    parser.add_argument("--max-tokens", type=_positive_int,
                        help="output tokens per request (default: the workload's own lengths)")
    parser.add_argument("--max-len", type=_positive_int, default=512,
                        help="the server's context in tokens: a prompt plus its output stays within it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS",
                        help="SLOs a request must meet to count as goodput, e.g. ttft:500 tpot:50 e2e:5000")
    parser.add_argument("--percentiles", default="50,90,95,99", help="comma-separated percentiles to report")
    parser.add_argument("--result-json", help="write the settings, the machine and every metric here")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_route(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", action="append", default=[], metavar="URL",
                        help="an OpenAI-compatible server (repeat for each)")
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="disaggregated: a prefill worker (serve --kv-role prefill); repeat for each")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="disaggregated: a decode worker (serve --kv-role decode); repeat for each")
    parser.add_argument("--policy", default="cache-aware", choices=["round-robin", "least-outstanding", "cache-aware"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="port (0: a free one, printed at start)")
    parser.add_argument("--tenants", help="a JSON file of tenants: API key, priority, request and token quotas")
    parser.add_argument("--worker-slots", type=_positive_int, default=64,
                        help="requests in flight per worker; more wait in the router, by priority")
    parser.add_argument("--health-interval", type=float, default=1.0, help="seconds between health probes")
    parser.add_argument("--admin-key", help="the key the /admin endpoints demand (none: they are off)")
    parser.add_argument("--cache-threshold", type=float, default=0.5,
                        help="cache-aware: the least share of the prompt a worker's tree must match")
    parser.add_argument("--balance-abs-threshold", type=int, default=32,
                        help="cache-aware: load is imbalanced when the busiest worker has this many more requests")
    parser.add_argument("--balance-rel-threshold", type=float, default=1.5,
                        help="... and this many times the least busy one's")
    parser.add_argument("--max-tree-chars", type=_positive_int, default=1_000_000,
                        help="cache-aware: characters each worker's tree keeps before LRU eviction")


def add_all(commands) -> None:
    """The three commands, on `infra-lab`'s subparsers."""
    serve = commands.add_parser("serve", help="serve a model over HTTP with the OpenAI API (chapter 06)",
                                description="An OpenAI-compatible server (completions, chat, streaming, "
                                            "/metrics, hot weight reload) over the book's engine.")
    add_serve(serve)
    serve.set_defaults(run=lambda args: _run("server", args))

    bench = commands.add_parser("bench", help="benchmarks: `bench serve` loads an OpenAI-compatible server")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="KIND")
    bench_serve = kinds.add_parser("serve", help="measure TTFT, TPOT, ITL, throughput and goodput over HTTP",
                                   description="Send a timed workload to any OpenAI-compatible server "
                                               "(this one, vLLM, SGLang), streaming every request.")
    add_bench_serve(bench_serve)
    bench_serve.set_defaults(run=lambda args: _run("loadgen", args))

    route = commands.add_parser("route", help="route requests over several servers (chapter 06)",
                                description="An OpenAI-compatible proxy over several servers: round robin, "
                                            "least outstanding or cache-aware routing, tenants with quotas "
                                            "and priorities, health checks.")
    add_route(route)
    route.set_defaults(run=lambda args: _run("route_command", args))


def _run(module: str, args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(f"infra_lab.orchestration.{module}").main(args)
