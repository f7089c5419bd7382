"""The engine's settings: memory (KV pool, swap space, prefix cache) and scheduling (the batching
policy, admission order, batch, token budget, chunk size, preemption), checked once, with errors
that name the setting.

The names follow vLLM's where there is one: `max_batch` is its max_num_seqs, `token_budget` its
max_num_batched_tokens, `chunk_size` its long_prefill_token_threshold, `num_speculative_tokens`
its own.
"""
from __future__ import annotations

from dataclasses import dataclass

from infra_lab.serving import scheduling

POLICIES = ("static", "dynamic", "continuous", "chunked")
PREEMPTION = ("recompute", "swap")
ORDERS = scheduling.ORDERS  # admission order: "fcfs", "longest-prefix", "dfs-weight"
PREFIX_CACHES = (None, "radix", "hash")


@dataclass(frozen=True)
class EngineConfig:
    policy: str = "chunked"  # one of POLICIES
    max_batch: int = 64  # requests running at once
    token_budget: int = 512  # tokens computed per step, prefill and decode together
    chunk_size: int | None = None  # most prompt tokens one request prefills in a step (chunked); None: budget
    num_blocks: int = 512  # KV blocks in the pool
    block_size: int = 16  # tokens per block
    host_blocks: int = 0  # swap space in host memory, in blocks; 0: preempt by recompute only
    preemption: str = "recompute"  # what a preempted request loses: "recompute" its KV, or "swap" it out
    prefix_cache: str | None = None  # "radix": chapter 04's tree over the pool (block_size 1); "hash":
    # chapter 03's block hashes (vLLM's automatic prefix caching: whole blocks, any block size)
    order: str = "fcfs"  # which waiting request is admitted first (serving.scheduling); one of ORDERS
    max_len: int | None = None  # dynamic batching: longest prompt + max_tokens a batch takes
    max_wait_s: float = 0.0  # dynamic batching: how long a partial batch waits to fill up
    max_waiting: int | None = None  # requests allowed to wait; more are rejected (None: no limit)
    num_speculative_tokens: int = 0  # γ: tokens drafted per decode and verified in its step (chapter 07)

    def __post_init__(self):
        def one_of(name, value, allowed):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")

        one_of("policy", self.policy, POLICIES)
        one_of("preemption", self.preemption, PREEMPTION)
        one_of("order", self.order, ORDERS)
        one_of("prefix_cache", self.prefix_cache, PREFIX_CACHES)
        for name in ("max_batch", "num_blocks", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.token_budget < self.block_size:
            raise ValueError(f"token_budget {self.token_budget} is smaller than one block ({self.block_size} "
                             "tokens); a step must be able to fill a block")
        if self.chunk_size is not None and not 1 <= self.chunk_size <= self.token_budget:
            raise ValueError(f"chunk_size must be in [1, token_budget={self.token_budget}] or None; "
                             f"got {self.chunk_size}")
        if self.host_blocks < 0:
            raise ValueError(f"host_blocks must be >= 0; got {self.host_blocks}")
        if self.preemption == "swap" and self.host_blocks == 0:
            raise ValueError("preemption='swap' needs swap space: set host_blocks >= 1")
        if self.prefix_cache == "radix" and self.block_size != 1:
            raise ValueError(f"the radix cache keeps one KV slot per token, so it needs block_size 1 (as "
                             f"SGLang's page size 1); got block_size {self.block_size}")
        if self.prefix_cache is not None and self.policy in ("static", "dynamic"):
            raise ValueError(f"the {self.prefix_cache} prefix cache works with the continuous and chunked policies; "
                             f"got {self.policy!r}")
        if self.prefix_cache == "hash" and self.preemption == "swap":
            raise ValueError("the hash prefix cache keeps swapped-out blocks' digests in the pool; swap preemption "
                             "needs prefix_cache=None or 'radix'")
        if self.order == "longest-prefix" and self.prefix_cache is None:
            raise ValueError("order='longest-prefix' ranks requests by their cached prefix: it needs "
                             "prefix_cache='radix' or 'hash'")
        if self.policy == "dynamic" and (self.max_len is None or self.max_len < 2):
            raise ValueError(f"dynamic batching needs max_len >= 2 (prompt + max_tokens); got {self.max_len}")
        if self.max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0; got {self.max_wait_s}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0 (0: no speculation); got "
                             f"{self.num_speculative_tokens}")
        if self.num_speculative_tokens and self.batch_at_once:
            raise ValueError(f"speculative decoding works with the continuous and chunked policies; got "
                             f"{self.policy!r}")
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 or None; got {self.max_waiting}")

    @property
    def chunked(self) -> bool:
        return self.policy == "chunked"

    @property
    def batch_at_once(self) -> bool:
        """Static and dynamic batching run a batch until its longest member ends."""
        return self.policy in ("static", "dynamic")

    @property
    def prefill_chunk(self) -> int:
        return self.chunk_size or self.token_budget
