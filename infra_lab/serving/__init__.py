"""Serving: the layer that schedules requests over kernels, KV bookkeeping and the model.

`scheduling` picks the order in which waiting requests are admitted, `workloads` generates
request streams that share prefixes and counts what a prefix cache saves, and `radix_serving`
runs the book's model through a radix cache.
"""
