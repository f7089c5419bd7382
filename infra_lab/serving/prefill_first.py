"""vLLM's scheduling before chunked prefill (v0.2 to v0.3, the baseline DistServe measured): a step
runs either prompts or decodes, never both. Whenever waiting prompts can be admitted, the step
prefills them alone and every running decode waits for it; otherwise the step decodes every
running request. Chapter 05's continuous policy (Orca's) instead lets the decodes ride along in a
prefill step, so they wait for the prompts but lose no step of their own.
"""
from __future__ import annotations

from infra_lab.serving.scheduler import Scheduler, StepPlan


class PrefillFirstScheduler(Scheduler):
    def _schedule_iteration(self, now_s: float) -> StepPlan:
        if self.waiting and not self.swapped:
            plan = StepPlan(budget=self.config.token_budget)
            for request in self._admission_order():
                if len(self.running) + 1 > self.config.max_batch or plan.budget == 0:
                    break
                if not self._admit_into(request, plan, now_s):
                    break
            if plan:
                return plan
        return super()._schedule_iteration(now_s)
