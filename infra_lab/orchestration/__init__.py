"""Orchestration (chapter 06): the engine behind HTTP, and what sits in front of several engines.

`server` is an OpenAI-compatible FastAPI app over one engine loop (serving.engine_loop), with
`openai_api` checking request bodies and shaping responses, `served` loading the model it serves,
`server_metrics` its Prometheus metrics and `weights_file` the checked files that a hot reload
loads. `loadgen` is a load generator that speaks only the OpenAI API (so it measures any such
server) and `bench_metrics` computes TTFT, TPOT, ITL and goodput from what it records. `router`
is an HTTP proxy over several servers with `policies` (round robin, least outstanding, cache
aware over `prefix_tree`) and `tenants` (token buckets and priorities); `rolling` replaces a
worker's weights through the router. `commands` declares the three commands (`infra-lab serve`,
`infra-lab bench serve`, `infra-lab route`) and `launch` starts them as processes.

Disaggregated prefill and decode (chapter 06, part 2): `kv_transfer` is the wire format and its
two transports (torch.distributed over gloo, shared memory), `pd_worker` a server's prefill or
decode role, `pd_router` the front that sends each request to both and deploys a pair;
`interference` and `transfer_speed` measure why and at what cost. `pd_claims`, `pd_headlines`
and `pd_explorer` put DistServe's, Splitwise's and vLLM's claims to the fleet simulator (they
need the model presets of `infra_lab.roofline`); `autoscaler_live` drives real workers with the
simulator's autoscalers.
"""
