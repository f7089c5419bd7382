"""The scheduler: which requests run in the next step, and how many tokens each computes.

- static: a batch of up to `max_batch` waiting requests runs until its longest member ends; its
  finished members hold their slots (and blocks) until then. It starts only when its members'
  prompts and max_tokens fit the pool, so it never preempts.
- dynamic: static, but a batch waits up to `max_wait_s` to fill, and takes only requests whose
  prompt + max_tokens fit `max_len` (the engine refuses a longer one at add_request, by name).
- continuous (iteration-level, Yu et al., "Orca", OSDI 2022): requests join and leave at every
  step. Each step decodes every running request, then admits waiting ones whose whole prompt fits
  what is left of `token_budget`.
- chunked (Agrawal et al., "Sarathi-Serve", OSDI 2024): decodes first, then prefill chunks (of at
  most `chunk_size` tokens per request) fill the rest of the budget, so a long prompt no longer
  stalls the decodes in its step.

With speculative decoding (chapter 07), a request whose step reaches the end of its known tokens
(a decode, or a prompt's last chunk) also gets room for up to `num_speculative_tokens` drafted
tokens: blocks and budget, as vLLM's lookahead slots.

When the pool runs out of blocks, the continuous and chunked policies preempt. The victim rule
(vLLM's): the running request admitted last goes first, so the oldest keep their progress. It
loses its blocks and waits at the head of the queue to be recomputed, or with swap space its
blocks go to host memory and come back before any new request is admitted.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from infra_lab.serving import scheduling
from infra_lab.serving.block_manager import BlockManager
from infra_lab.serving.config import EngineConfig
from infra_lab.serving.request import Request, RequestState


@dataclass
class StepPlan:
    batch: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens it computes)
    preempted: list[Request] = field(default_factory=list)
    swapped_out: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)
    held: list[Request] = field(default_factory=list)  # a static batch's finished members
    budget: int = 0  # tokens still free in this step

    def __bool__(self) -> bool:
        return bool(self.batch)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager):
        self.config, self.blocks = config, blocks
        self.waiting: deque[Request] = deque()  # arrival order; preempted requests rejoin at the head
        self.running: list[Request] = []  # admission order: the last one is the first victim
        self.swapped: deque[Request] = deque()  # preempted to host memory, oldest first
        self.admitted: list[tuple[Request, float | None, int]] = []  # the last schedule's admissions, with
        # each one's admitted_s and cached_tokens before it: what undoing them restores

    # ---- admission: can a request ever run? ---------------------------------------------------------

    def check_fits(self, request_id, prompt_tokens: int, params) -> None:
        """Raise ValueError naming the rule a request of `prompt_tokens` with `params` breaks, one
        that no wait would cure: the engine asks when the request is added (or imported), so that
        every request in the queues is one this scheduler's admission can take once there is room."""
        config, total = self.config, prompt_tokens + params.max_tokens
        longest = total - 1  # tokens whose K and V are ever stored: the last one sampled is not run
        where = f"request {request_id}: {prompt_tokens} prompt tokens + max_tokens {params.max_tokens}"
        pool_tokens = self.blocks.capacity_tokens
        if (total if config.batch_at_once else longest) > pool_tokens:
            raise ValueError(f"{where} needs more KV than the whole pool holds ({config.num_blocks} blocks of "
                             f"{config.block_size} = {pool_tokens} tokens)")
        if params.n > 1 and config.batch_at_once:
            raise ValueError(f"request {request_id}: n={params.n} samples join the running batch when their prompt "
                             f"is computed; the {config.policy!r} policy fixes a batch when it starts: use "
                             "'continuous' or 'chunked'")
        if params.n > config.max_batch:
            raise ValueError(f"request {request_id}: n={params.n} samples run together, more than max_batch "
                             f"{config.max_batch}")
        if config.policy == "dynamic" and total > config.max_len:
            raise ValueError(f"{where} = {total} is longer than dynamic batching's max_len {config.max_len}: "
                             "the published loop would never take it, and never end")
        if config.policy == "continuous" and longest > config.token_budget:
            raise ValueError(f"{where}: without chunking, a prompt (or its recompute after a preemption, "
                             f"up to {longest} tokens) must fit one step's token_budget {config.token_budget}; "
                             "use policy='chunked' or a larger budget")

    # ---- queues ------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of whichever queue holds it (it finished or was aborted)."""
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        if self.config.batch_at_once:  # an aborted batch's last unfinished member ends the batch
            self._end_batch_if_done()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def next_decision_s(self, now_s: float) -> float | None:
        """When a dynamic batch that is waiting to fill will start anyway (None: not waiting)."""
        if self.config.policy == "dynamic" and not self.running and self.waiting:
            return self.waiting[0].arrival_s + self.config.max_wait_s
        return None

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self, now_s: float) -> StepPlan:
        self.admitted = []
        if self.config.batch_at_once:
            return self._schedule_batch(now_s)
        return self._schedule_iteration(now_s)

    def join(self, request: Request, now_s: float) -> None:
        """A sample of an n > 1 request joins the running batch: it forked from its prompt's
        blocks in the step that computed them, and its first token is drawn."""
        request.state, request.admitted_s = RequestState.RUNNING, now_s
        self.running.append(request)

    def unadmit(self, request: Request, admitted_s: float | None, cached_tokens: int) -> None:
        """Undo an admission (the step it was admitted for failed): it waits again, first in line."""
        self.running.remove(request)
        self.blocks.release(request)
        request.state, request.admitted_s, request.cached_tokens = RequestState.WAITING, admitted_s, cached_tokens
        self.waiting.appendleft(request)

    def recompute_all(self) -> None:
        """Every request holding K and V (in the pool or swapped out) gives it back and waits, in
        its order, to compute its prompt and output again (new weights make the old K and V wrong)."""
        for request in reversed(self.swapped):
            self.blocks.drop(request)
            request.state = RequestState.PREEMPTED
            self.waiting.appendleft(request)
        self.swapped.clear()
        if self.config.batch_at_once:  # a static batch keeps its members: they recompute in place
            for request in self.running:
                if not request.is_done:
                    self.blocks.release(request)
                    self.blocks.start(request)
            return
        for request in reversed(self.running):
            self.blocks.release(request)
            request.state = RequestState.PREEMPTED
            self.waiting.appendleft(request)
        self.running.clear()

    def finished(self, request: Request) -> None:
        """A request finished in the last step: its blocks go back, unless a static batch holds them."""
        if self.config.batch_at_once:
            self._end_batch_if_done()
            return
        self.running.remove(request)
        self.blocks.release(request)

    # ---- static and dynamic ---------------------------------------------------------------------

    def _end_batch_if_done(self) -> None:
        """Once every member of the batch is done, all leave together and hand back their blocks."""
        if all(r.is_done for r in self.running):
            for member in self.running:
                self.blocks.release(member)
            self.running.clear()

    def _schedule_batch(self, now_s: float) -> StepPlan:
        plan = StepPlan()
        if not self.running:
            self._form_batch(now_s)
        for request in self.running:
            if request.is_done:
                plan.held.append(request)
            else:
                self.blocks.reserve(request, request.num_uncomputed)  # fits: the batch started with its worst case
                plan.batch.append((request, request.num_uncomputed))
        return plan

    def _form_batch(self, now_s: float) -> None:
        config = self.config
        if not self.waiting:
            return
        if config.policy == "dynamic":
            full = len(self.waiting) >= config.max_batch
            if not full and now_s < self.waiting[0].arrival_s + config.max_wait_s:
                return  # wait for more to arrive
        free = self.blocks.pool.num_free
        while self.waiting and len(self.running) < config.max_batch:
            request = self.waiting[0]
            need = -(-(len(request.prompt) + request.params.max_tokens) // self.blocks.block_size)  # its worst case
            if need > free:
                break
            free -= need
            self._admit(self.waiting.popleft(), now_s)

    # ---- continuous and chunked -----------------------------------------------------------------

    def _schedule_iteration(self, now_s: float) -> StepPlan:
        config, plan = self.config, StepPlan(budget=self.config.token_budget)
        is_decode = [bool(r.output) and r.num_uncomputed == 1 for r in self.running]
        decoding = [r for r, d in zip(self.running, is_decode) if d]
        prefilling = [r for r, d in zip(self.running, is_decode) if not d]  # prompt chunks (or a recompute's)
        for request in decoding + prefilling:  # decodes first, each in admission order
            if request.state is not RequestState.RUNNING or plan.budget == 0:
                continue  # preempted while making room for an older one, or no budget left
            n = min(request.num_uncomputed, config.prefill_chunk, plan.budget)
            extra = self._draft_room(request, n, plan)
            if self._room_for(request, n + extra, plan):
                self._plan(request, n, plan, extra)
        if plan.preempted:
            return plan  # memory is short: admit nothing until the running ones need less
        # swapped requests come back before new ones are admitted, oldest first; then the waiting
        # ones in admission order; the first that does not fit ends admission (order holds)
        for request in list(self.swapped) + self._admission_order():
            if len(self.running) + 1 + len(request.samples) > config.max_batch or plan.budget == 0:
                break  # (an n > 1 request's samples join the batch when its prompt is computed)
            if not self._admit_into(request, plan, now_s):
                break
        return plan

    def _admit_into(self, request: Request, plan: StepPlan, now_s: float) -> bool:
        """Admit a swapped or waiting request into this step if the step's budget and the pool
        have room for its next chunk (and its drafts); False, with nothing changed, if not."""
        config, blocks = self.config, self.blocks
        swapped = request.request_id in blocks.swapped
        if not swapped and not config.chunked and request.num_uncomputed - blocks.cached_prefix(request) > plan.budget:
            return False  # without chunking, the whole prompt must fit this step's budget
        cached = 0 if swapped else blocks.start(request)  # its cached prefix is locked from here on
        n = min(request.num_uncomputed, config.prefill_chunk, plan.budget)
        extra = self._draft_room(request, n, plan)
        need = blocks.swap_in_blocks(request, n + extra) if swapped else blocks.blocks_needed(request, n + extra)
        if not blocks.make_room(need):
            if not swapped:
                blocks.release(request)  # undo the start; it waits
            return False
        if swapped:
            self.swapped.remove(request)
            blocks.swap_in(request)
            self.running.append(request)
            request.state = RequestState.RUNNING
            plan.swapped_in.append(request)
            self._room_for(request, n + extra, plan)  # made above: the swapped blocks plus the new tokens'
        else:
            self.waiting.remove(request)
            self._admit(request, now_s)
            request.cached_tokens += cached
        self._plan(request, n, plan, extra)
        return True

    def _plan(self, request: Request, n: int, plan: StepPlan, draft_room: int = 0) -> None:
        """Put `request` in the step with `n` tokens, and room for `draft_room` drafted ones after
        them (speculative decoding); their blocks are reserved now, so the room that later
        requests see is what is really left."""
        self.blocks.reserve(request, n + draft_room)
        request.draft_room = draft_room
        plan.batch.append((request, n))
        plan.budget -= n + draft_room

    def _draft_room(self, request: Request, n: int, plan: StepPlan) -> int:
        """Speculative decoding: drafted tokens a request may verify in this step, after its `n`.
        Any step that reaches the end of its known tokens can carry drafts (a decode, or a
        prompt's last chunk); they count against the budget and need blocks like any token."""
        if n < request.num_uncomputed:
            return 0
        return max(min(self.config.num_speculative_tokens, plan.budget - n, request.draftable), 0)

    def _admission_order(self) -> list[Request]:
        """The waiting requests in the config's order (serving.scheduling); a request's cached
        prefix is that of all but its last token, which must run for logits."""
        waiting = list(self.waiting)
        if self.config.order == "fcfs":
            return waiting
        indices = scheduling.admission_order(self.config.order, [r.tokens[:-1] for r in waiting],
                                             self.blocks.prefix_index)
        return [waiting[i] for i in indices]

    def _admit(self, request: Request, now_s: float) -> None:
        self.admitted.append((request, request.admitted_s, request.cached_tokens))
        if request.seq is None:
            request.cached_tokens += self.blocks.start(request)
        request.state = RequestState.RUNNING
        if request.admitted_s is None:
            request.admitted_s = now_s
        self.running.append(request)

    def _room_for(self, request: Request, n: int, plan: StepPlan) -> bool:
        """Free blocks for `request`'s next `n` tokens, preempting the last admitted running
        requests while the pool is short; False if `request` itself had to go."""
        while not self.blocks.make_room(self.blocks.blocks_needed(request, n)):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        self.running.remove(victim)
        for entry in [e for e in plan.batch if e[0] is victim]:  # planned already: its tokens wait
            plan.batch.remove(entry)
            plan.budget += entry[1] + victim.draft_room
            self.blocks.unreserve(victim)  # and the blocks _plan reserved for them go back
        victim.state, victim.preemptions = RequestState.PREEMPTED, victim.preemptions + 1
        plan.preempted.append(victim)
        if self.config.preemption == "swap" and self.blocks.can_swap_out(victim):
            self.blocks.swap_out(victim)
            self.swapped.append(victim)
            plan.swapped_out.append(victim)
        else:  # recompute: its prompt and output so far are prefilled again when it returns
            self.blocks.release(victim)
            self.waiting.appendleft(victim)
