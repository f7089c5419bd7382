"""Serving: the layer that schedules requests over kernels, KV bookkeeping and the model.

Chapter 04: `scheduling` picks the order in which waiting requests are admitted, `workloads`
generates request streams that share prefixes and counts what a prefix cache saves, and
`radix_serving` runs the book's model through a radix cache.

Chapter 05, the book's one serving engine: `engine` (requests in, tokens out, one step at a time;
n samples, log-probabilities, weight updates, requests that move between engines), `scheduler`
(static, dynamic, continuous and chunked-prefill policies; admission; preemption),
`block_manager` (the only writer of the pool's books: KV blocks per request, the radix or
block-hash prefix cache, forks, swap), `runner` (one forward per step over the mixed batch,
behind `run(batch) -> RunnerOutput`), `request`, `config`, `steplog` and `metrics` (TTFT, TPOT,
goodput from the step log), `clock`, `traffic` (timed workloads), `simulator` (the same engine on
a roofline step-time model) and `dynamic_batching` (the published loop, kept as a baseline).

The engine as a service (chapters 06 and 11 stand on it): `engine_loop` steps an engine from a
thread of its own while any thread or asyncio task submits, streams, aborts, updates weights and
moves requests.

Fleets (chapter 06, part 2): `pd_fleet` and `pd_fleet_loop` simulate colocated and disaggregated
deployments of simulated engines on virtual clocks, `prefill_first` the 2023 vLLM schedule,
`goodput` finds the highest rate within the objectives, `placement` DistServe's search, `links`
the interconnects a KV transfer crosses; `autoscaling` holds the autoscalers, `bursty` the 5×
trace, `autoscaling_replay` a fleet that grows and shrinks, `autoscaling_study` the comparison.
"""
