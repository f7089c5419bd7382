"""Serving: the layer that schedules requests over kernels, KV bookkeeping and the model.

`scheduling` picks the order in which waiting requests are admitted, `workloads` generates
request streams that share prefixes and counts what a prefix cache saves, and `radix_serving`
runs the book's model through a radix cache. `request` and `runner` are the engine's first parts
(chapter 05): a request with its sampling parameters and state, and the runner that computes one
mixed batch per step through the model's one `step`.
"""
