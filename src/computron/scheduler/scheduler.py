"""Scheduler: per-model FIFO queues, iteration-level batching and residency decisions.

Input: requests and models (sizes in bytes) and, after each step, which requests finished.
Output: a ``StepPlan`` per step. It never touches a tensor: the engine applies the plan to real
memory and the simulator applies it to a cost model.

Policies:
- ``default``: memory accounted in bytes (weights + reserved KV cache) against ``budget``;
  the model holding the oldest outstanding request runs; idle models are evicted
  least-recently-used; the next model with work is prefetched while this one computes, when it
  fits without evicting a model that has work.
- ``computron``: the original Computron: at most ``max_loaded`` models resident (a count, not
  bytes), first-come-first-served across models, no prefetch. (Its swap mechanics, full load
  before compute and copy-back on eviction, live in the executor.)
"""

from __future__ import annotations

from dataclasses import dataclass

from .state import ModelState, SchedRequest, StepPlan

POLICIES = ("default", "computron")


@dataclass
class SchedulerConfig:
    budget: int  # bytes for weights + KV cache on the device
    policy: str = "default"
    max_batch_size: int = 32
    max_tokens_per_step: int = 2048
    max_loaded: int = 1  # computron policy only
    prefetch: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        for name in ("budget", "max_batch_size", "max_tokens_per_step", "max_loaded"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.models: dict[str, ModelState] = {}
        self.requests: dict[str, SchedRequest] = {}
        self.step_count = 0

    # ---- bookkeeping -------------------------------------------------------------------------
    def add_model(self, name: str, weight_bytes: int, pinned: bool = False) -> None:
        if name in self.models:
            raise ValueError(f"model {name!r} is already registered")
        if self.config.policy == "default" and weight_bytes > self.config.budget:
            raise ValueError(f"model {name!r} needs {weight_bytes} bytes of weights, more than the whole "
                             f"budget of {self.config.budget} bytes")
        self.models[name] = ModelState(name, weight_bytes, pinned)

    def remove_model(self, name: str) -> None:
        m = self._model(name)
        if m.has_work:
            raise ValueError(f"model {name!r} still has {len(m.waiting) + len(m.running)} requests")
        del self.models[name]

    def set_pinned(self, name: str, pinned: bool) -> None:
        self._model(name).pinned = pinned

    def add_request(self, req: SchedRequest) -> None:
        m = self._model(req.model)
        if req.id in self.requests:
            raise ValueError(f"request id {req.id!r} is already in use")
        need = req.kv_bytes + (m.weight_bytes if self.config.policy == "default" else 0)
        if need > self.config.budget:
            raise ValueError(f"request {req.id!r} needs {req.kv_bytes} bytes of KV cache; with the model's "
                             f"{m.weight_bytes} bytes that exceeds the budget of {self.config.budget} bytes")
        self.requests[req.id] = req
        m.waiting.append(req)

    def finish(self, req_id: str) -> None:
        """A request ended (completed, failed or cancelled): drop it and free its KV reservation."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return
        m = self.models[req.model]
        if req.state == "running":
            m.running.remove(req)
        else:
            m.waiting.remove(req)
        req.state = "finished"

    def update(self, plan: StepPlan, finished: list[str]) -> None:
        for rid in plan.decode + plan.prefill:
            if rid in self.requests:
                self.requests[rid].generated += 1
        for rid in finished:
            self.finish(rid)

    def plan_load(self, name: str) -> StepPlan:
        """A plan that makes ``name`` resident now (admin load), evicting idle models if needed."""
        m = self._model(name)
        plan = StepPlan()
        if not self._ensure_resident(m, set(), plan, plan.loads):
            raise ValueError(f"model {name!r} does not fit next to the models that are busy or pinned")
        return plan

    def mark_evicted(self, name: str) -> None:
        """The engine dropped a model on its own (admin offload)."""
        m = self._model(name)
        if m.has_work:
            raise ValueError(f"model {name!r} has requests in flight; it cannot be offloaded now")
        m.resident = False

    def _model(self, name: str) -> ModelState:
        try:
            return self.models[name]
        except KeyError:
            raise KeyError(f"unknown model {name!r}; registered: {', '.join(self.models) or 'none'}") from None

    # ---- memory ------------------------------------------------------------------------------
    def used_bytes(self) -> int:
        weights = sum(m.weight_bytes for m in self.models.values() if m.resident)
        kv = sum(m.kv_bytes for m in self.models.values())
        return (kv if self.config.policy == "computron" else weights + kv)

    def resident_models(self) -> list[str]:
        return [m.name for m in self.models.values() if m.resident]

    def _evictable(self, keep: set[str]) -> list[ModelState]:
        idle = [m for m in self.models.values()
                if m.resident and not m.has_work and not m.pinned and m.name not in keep]
        return sorted(idle, key=lambda m: m.last_used)

    def _make_room(self, nbytes: int, keep: set[str], plan: StepPlan) -> bool:
        """Evict idle models (LRU) until ``nbytes`` more fit; plan the evictions only if it works."""
        free = self.config.budget - self.used_bytes()
        victims = []
        for m in self._evictable(keep):
            if free >= nbytes:
                break
            victims.append(m)
            free += m.weight_bytes
        if free < nbytes:
            return False
        for m in victims:
            m.resident = False
            plan.evictions.append(m.name)
        return True

    def _make_slot(self, keep: set[str], plan: StepPlan) -> bool:
        """Computron policy: free a slot under ``max_loaded`` by evicting one idle model."""
        if len(self.resident_models()) < self.config.max_loaded:
            return True
        victims = self._evictable(keep)
        if not victims:
            return False
        victims[0].resident = False
        plan.evictions.append(victims[0].name)
        return True

    def _ensure_resident(self, m: ModelState, keep: set[str], plan: StepPlan, into: list[str]) -> bool:
        if m.resident:
            return True
        keep = keep | {m.name}
        ok = self._make_slot(keep, plan) if self.config.policy == "computron" else self._make_room(m.weight_bytes, keep, plan)
        if ok:
            m.resident = True
            into.append(m.name)
        return ok

    # ---- the step ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self.step_count += 1
        plan = StepPlan()
        busy = sorted((m for m in self.models.values() if m.has_work), key=lambda m: m.oldest_arrival())
        target = None
        for m in busy:
            if self._ensure_resident(m, set(), plan, plan.loads):
                target = m
                break
        if target is None:
            if busy and not any(m.resident and m.has_work for m in self.models.values()):
                # Nothing can run and nothing will free memory: the head request cannot be served.
                head = busy[0].waiting[0]
                plan.failed.append((head.id, self._cannot_load_reason(busy[0])))
                self.finish(head.id)
            return plan
        self._admit(target, plan)
        target.last_used = self.step_count
        plan.model = target.name
        if self.config.prefetch and self.config.policy == "default":
            for m in busy:
                if m is not target and not m.resident:
                    self._ensure_resident(m, {target.name} | {b.name for b in busy}, plan, plan.prefetch)
                    break
        return plan

    def _cannot_load_reason(self, m: ModelState) -> str:
        pinned = [p.name for p in self.models.values() if p.resident and p.pinned]
        return (f"model {m.name!r} ({m.weight_bytes} bytes) cannot be loaded: the budget is "
                f"{self.config.budget} bytes and pinned models ({', '.join(pinned) or 'none'}) hold the rest")

    def _admit(self, m: ModelState, plan: StepPlan) -> None:
        cfg = self.config
        plan.decode = [r.id for r in m.running]
        tokens = len(plan.decode)
        while m.waiting and len(m.running) < cfg.max_batch_size:
            req = m.waiting[0]
            if plan.prefill and tokens + req.prompt_len > cfg.max_tokens_per_step:
                break
            if self.config.budget - self.used_bytes() < req.kv_bytes and not self._make_room(
                    req.kv_bytes, {m.name}, plan):
                if not m.running:
                    plan.failed.append((req.id, f"request {req.id!r} needs {req.kv_bytes} bytes of KV cache "
                                                f"and only {self.config.budget - self.used_bytes()} can be freed"))
                    self.finish(req.id)
                    continue
                break
            m.waiting.popleft()
            req.state = "running"
            m.running.append(req)
            plan.prefill.append(req.id)
            tokens += req.prompt_len
