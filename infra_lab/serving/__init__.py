"""Serving: the layer that schedules requests over kernels, KV bookkeeping and the model.

Chapter 04: `scheduling` picks the order in which waiting requests are admitted, `workloads`
generates request streams that share prefixes and counts what a prefix cache saves, and
`radix_serving` runs the book's model through a radix cache.

Chapter 05, the book's one serving engine: `engine` (requests in, tokens out, one step at a time),
`scheduler` (static, dynamic, continuous and chunked-prefill policies; preemption), `block_manager`
(KV blocks per request, the radix cache, swap), `runner` (one forward per step over the mixed
batch), `request`, `config`, `steplog` and `metrics` (TTFT, TPOT, goodput from the step log),
`clock`, `traffic` (timed workloads), `simulator` (the same engine on a roofline step-time model)
and `dynamic_batching` (the published loop, kept as a baseline).
"""
