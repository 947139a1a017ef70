"""The scheduler's memory side: bytes per device, which models may be evicted (and which paused
requests' KV blocks given up) to make room, and switching a device to a model whose request has
waited too long (the ``preempt`` policy).

A mixin of ``Scheduler`` (its state lives there): pure, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .state import LOADING, OFFLOADED, ModelState, SchedRequest, StepPlan

if TYPE_CHECKING:
    from .scheduler import SchedulerConfig
    from .slo import Deadlines


class Memory:
    # The scheduler's state these methods use (``Scheduler.__init__`` sets it): declared here so the
    # mixin type-checks on its own (and compiles, ``scripts/build_fast.sh``); annotations only.
    config: SchedulerConfig
    budgets: tuple[int, ...]
    counts_bytes: bool
    keeps_kv: bool
    slo: Deadlines | None
    kv_host: int
    host_used: int
    kv_offloaded: int
    kv_restored: int
    kv_moved_bytes: int
    _yielded: dict[str, str]
    switches: int
    weights_used: list[int]
    kv_used: list[int]
    staging_used: list[int]
    lent: dict[int, str]
    on_device: list[dict[str, ModelState]]
    models: dict[str, ModelState]
    _fresh: set[str]
    _epoch: int
    shares: list[int]
    free: list[int]

    def _preempt(self, m: ModelState, req: SchedRequest, plan: StepPlan) -> None:
        raise NotImplementedError  # the scheduler's

    def free_bytes(self, device: int) -> int:
        return self.free[device]

    def _count_free(self, device: int) -> None:
        """``free[device]``: its share less what is booked (weights, when they count, and KV cache)."""
        used = self.kv_used[device] + self.staging_used[device] + (self.weights_used[device] if self.counts_bytes else 0)
        self.free[device] = self.shares[device] - used

    def set_budget(self, device: int, nbytes: int) -> StepPlan:
        """From now on inference may use ``nbytes`` of ``device`` (capped at its configured budget,
        which stays the ceiling requests are checked against). The plan evicts models with nothing
        running, least recently used first, until what is booked fits; running requests keep their
        memory until they end, and nothing new is admitted meanwhile."""
        if nbytes < 0:
            raise ValueError(f"a budget must be >= 0 bytes, got {nbytes}")
        self.shares[device] = min(nbytes, self.budgets[device])
        self._count_free(device)
        self._epoch += 1
        plan = StepPlan()
        idle = sorted((c for c in self.on_device[device].values() if not c.running and not c.pinned),
                      key=lambda c: c.last_used)
        for c in idle:
            if self.free_bytes(device) >= 0:
                break
            self._set_offloaded(c)
            plan.evictions.append(c.name)
        return plan

    def need_bytes(self, device: int) -> int:
        """Bytes the work on ``device`` needs (at most its configured budget): the weights of every
        model with requests, and each request's KV cache at its full length (waiting requests: up
        to a batch per model), so that what it asks for is enough to finish."""
        total = 0
        for m in self.models.values():
            if device not in m.devices or not m.has_work:
                continue
            i = m.devices.index(device)
            reqs = [*m.running.values(), *m.paused.values(), *list(m.waiting)[:self.config.max_batch_size]]
            total += (m.weights[i] if self.counts_bytes else 0) + m.block_bytes[i] * sum(
                self._blocks(r.prompt_len + r.max_tokens) for r in reqs)
        return min(total, self.budgets[device])

    def _set_on_device(self, m: ModelState, now: float) -> None:
        self._epoch += 1
        m.state = LOADING
        if self._yielded:  # those that stopped for m may run again
            for name in [k for k, v in self._yielded.items() if v == m.name]:
                del self._yielded[name]
        if m.paused:  # they run on where they stopped: their blocks are booked, their heap entries live again
            for req in m.paused.values():
                req.state = "running"
            m.running, m.paused = m.paused, {}
        bw = self.config.load_bandwidth
        m.ready_at = now + max(m.weights) / bw if bw else None
        if self.slo is not None:  # through its own links (``_lend`` counts the helpers it gets)
            m.ready_at = now + self.slo.costs[m.name].load(0 if self.config.stripe_devices else None)
        for d, w in zip(m.devices, m.weights):
            self.weights_used[d] += w
            self.on_device[d][m.name] = m
            self._count_free(d)

    def _lend(self, m: ModelState, plan: StepPlan, now: float) -> None:
        """Striped swap-in: lend the load of ``m`` (on one device) the host links of the stripe devices
        that are idle (no load in flight there, not lent to another load) and have room for the
        staging they lend, which is booked on their budgets until the load ends (``_return_links``).
        Idle links only: a device's own load is never slowed by another's, and a device helps one
        load at a time, so helpers never wait on each other in a cycle."""
        cfg = self.config
        helpers = self._idle_links(m)
        if not helpers:
            return
        m.helpers = helpers
        for d in helpers:
            self.lent[d] = m.name
            self.staging_used[d] += cfg.stripe_staging
            self._count_free(d)
        plan.stripes[m.name] = helpers
        bw = cfg.load_bandwidth
        if self.slo is not None:
            m.ready_at = now + self.slo.costs[m.name].load(len(helpers))
        elif bw:
            m.ready_at = now + max(m.weights) / (bw * (1 + len(helpers)))

    def _idle_links(self, m: ModelState) -> tuple[int, ...]:
        """The stripe devices whose links a load of ``m`` would be lent now (``_lend``)."""
        cfg = self.config
        if not cfg.stripe_devices or len(m.devices) != 1:
            return ()
        home = m.devices[0]
        return tuple(d for d in cfg.stripe_devices if d != home and d not in self.lent
                     and self.free[d] >= cfg.stripe_staging
                     and not any(c.state == LOADING for c in self.on_device[d].values()))

    def _return_links(self, m: ModelState) -> None:
        """The load of ``m`` ended (or was undone): its helpers' links and staging are free again."""
        for d in m.helpers:
            del self.lent[d]
            self.staging_used[d] -= self.config.stripe_staging
            self._count_free(d)
        m.helpers = ()
        self._epoch += 1

    def _set_offloaded(self, m: ModelState) -> None:
        self._epoch += 1
        if m.helpers:
            self._return_links(m)
        m.state, m.ready_at = OFFLOADED, None
        for d, w in zip(m.devices, m.weights):
            self.weights_used[d] -= w
            del self.on_device[d][m.name]
            self._count_free(d)

    def _victims(self, m: ModelState, need: dict[int, int], keep: set[str], evict_waiting: bool
                 ) -> tuple[list[ModelState], list[SchedRequest]] | None:
        """Models to evict (least recently used first) so ``need[d]`` more bytes fit on each device d,
        then, if those are not enough (and ``evict_waiting``), paused requests that give up their KV
        blocks; None when it cannot be done. Only models with nothing running are candidates."""
        free = self.free
        short = {d: n - free[d] for d, n in need.items() if n > free[d]}
        if not short:
            return [], []
        fresh = self._fresh
        cands = {c.name: c for d in short for c in self.on_device[d].values()
                 if not c.running and not c.pinned and c.name not in keep and c.name not in fresh
                 and (evict_waiting or not c.waiting)}
        if not cands and not (evict_waiting and self.keeps_kv):
            return None  # nothing to evict, no paused blocks to take
        victims = []
        for c in sorted(cands.values(), key=lambda c: c.last_used):
            if not short:
                break
            touches = [d for d in c.devices if d in short]
            if not touches:
                continue
            victims.append(c)
            for d, w in zip(c.devices, c.weights):
                if d in short:
                    short[d] -= w
                    if short[d] <= 0:
                        del short[d]
        paused = self._paused_victims(short) if short and evict_waiting and self.keeps_kv else []
        return None if short else (victims, paused)

    def _paused_victims(self, short: dict[int, int]) -> list[SchedRequest]:
        """Paused requests whose blocks cover ``short`` (taken off it), the cheapest to recompute
        (prompt and tokens made) first. A prompt's shared blocks count once its last holder is chosen."""
        reqs = sorted((r for c in self.models.values() if c.paused and not short.keys().isdisjoint(c.devices)
                       for r in c.paused.values() if r.state == "paused"),
                      key=lambda r: r.prompt_len + self.models[r.model].steps - r.joined)
        left: dict = {}  # shared prefix -> its holders not chosen yet
        chosen = []
        for r in reqs:
            if not short:
                break
            c = self.models[r.model]
            if short.keys().isdisjoint(c.devices):
                continue
            blocks, p = r.blocks, r.prefix
            if p is not None and p.blocks:
                left[p] = left.get(p, p.holders) - 1
                if left[p]:
                    blocks -= p.blocks
            chosen.append(r)
            for d, bb in zip(c.devices, c.block_bytes):
                if d in short:
                    short[d] -= blocks * bb
                    if short[d] <= 0:
                        del short[d]
        return chosen

    def _make_room(self, m: ModelState, need: dict[int, int], keep: set[str], plan: StepPlan,
                   evict_waiting: bool) -> bool:
        found = self._victims(m, need, keep, evict_waiting)
        if found is None:
            return False
        for v in found[0]:
            self._set_offloaded(v)
            plan.evictions.append(v.name)
        for r in found[1]:  # their blocks move to host memory where it pays and fits, else they recompute
            c = self.models[r.model]
            if c.name not in keep and self._may_offload(c, r):
                self._offload(c, r, plan)
                continue
            self._preempt(c, r, plan)
            if r.id in plan.paused:  # paused by this plan: its cache goes now
                plan.paused.remove(r.id)
        return True

    def _host_bytes(self, c: ModelState, r: SchedRequest) -> int:
        return r.blocks * sum(c.block_bytes)

    def _may_offload(self, c: ModelState, r: SchedRequest, extra: int = 0) -> bool:
        """May the paused request ``r`` of ``c`` move its blocks to host memory (``extra`` bytes of it
        being promised already)? Only a request of its own blocks (no prompt shared with other choices),
        while the host budget allows, and (slo policy) when moving them out and back costs less than
        recomputing them."""
        if not self.kv_host or r.prefix is not None or r.state not in ("paused", "running"):
            return False
        if self.host_used + extra + self._host_bytes(c, r) > self.kv_host:
            return False
        return self.slo is None or self.slo.moves(c, r)

    def _offload(self, c: ModelState, r: SchedRequest, plan: StepPlan) -> None:
        """Move a paused request's blocks to host memory: free on the devices, booked on the host."""
        r.state = "offloaded"
        self._take_blocks(c, -r.blocks)
        n = self._host_bytes(c, r)
        self.host_used += n
        self.kv_offloaded += 1
        self.kv_moved_bytes += n
        plan.kv_out.append(r.id)

    def _host_blocks(self, m: ModelState) -> int:
        """Blocks of ``m``'s paused requests that wait in host memory (booked on its devices when it loads)."""
        return sum(r.blocks for r in m.paused.values() if r.state == "offloaded") if self.host_used else 0

    def _restore(self, m: ModelState, plan: StepPlan) -> None:
        """``m`` goes on its devices: its offloaded requests' blocks come back (booked on the devices)."""
        for r in m.paused.values():
            if r.state == "offloaded":
                n = self._host_bytes(m, r)
                self.host_used -= n
                self.kv_restored += 1
                self.kv_moved_bytes += n
                self._take_blocks(m, r.blocks)
                r.state = "paused"
                plan.kv_in.append(r.id)

    def _make_slot(self, m: ModelState, keep: set[str], plan: StepPlan) -> bool:
        """Computron policy: a free slot under ``max_loaded`` on each of the model's devices."""
        for d in m.devices:
            if len(self.on_device[d]) < self.config.max_loaded:
                continue
            idle = [c for c in self.on_device[d].values()
                    if not c.running and not c.pinned and c.name not in keep and c.name not in self._fresh]
            if not idle:
                return False
            v = min(idle, key=lambda c: c.last_used)
            self._set_offloaded(v)
            plan.evictions.append(v.name)
        return True

    def _make_resident(self, m: ModelState, keep: set[str], plan: StepPlan, into: list[str], now: float,
                       evict_waiting: bool) -> bool:
        if m.on_device:
            return True
        keep = keep | {m.name}
        if self.counts_bytes:
            host = self._host_blocks(m)  # its requests' blocks in host memory come back with it
            ok = self._make_room(m, {d: w + host * bb for d, w, bb in zip(m.devices, m.weights, m.block_bytes)},
                                 keep, plan, evict_waiting)
        else:
            ok = self._make_slot(m, keep, plan)
        if ok:
            if self.host_used:
                self._restore(m, plan)
            self._set_on_device(m, now)
            self._lend(m, plan, now)
            self._fresh.add(m.name)
            into.append(m.name)
        return ok

    def _switch_to(self, m: ModelState, plan: StepPlan, now: float, order: list[ModelState] | None = None) -> bool:
        """Preempt policy: stop the models that keep ``m`` from starting (those whose requests have
        made the fewest tokens first) until ``m`` can start without recomputing anything, or all are
        stopped. A stopped model is evicted and its requests paused, their blocks kept
        (``plan.paused``); what ``m`` still lacks is taken from paused requests, which then recompute
        (``plan.preempted``); with ``preempt_keeps_kv`` off, stopped requests always recompute. False
        (nothing stopped) when even stopping them all would not do. The slo policy gives the
        ``order`` (the models it may stop) and keeps only the caches the switch leaves room for."""
        if order is None:
            blockers = {c.name: c for d in m.devices for c in self.on_device[d].values()
                        if c is not m and c.running and not c.pinned}
            order = sorted(blockers.values(), key=lambda c: sum(c.steps - r.joined for r in c.running.values()))
        need = self._start_need(m)
        freed = {d: self.free_bytes(d) for d in need}
        for c in order:  # would stopping them all make room? (evicting them, and idle models, too)
            for d, w, bb in zip(c.devices, c.weights, c.block_bytes):
                if d in freed:
                    freed[d] += w + bb * sum(r.blocks for r in c.running.values())
        idle = {d: sum(i.weights[i.devices.index(d)] for i in self.on_device[d].values()
                       if i is not m and not i.running and not i.pinned) for d in need}
        if self.keeps_kv:  # blocks of requests paused before
            for c in self.models.values():
                for d, bb in zip(c.devices, c.block_bytes):
                    if c.paused and d in idle:
                        idle[d] += bb * sum(r.blocks for r in c.paused.values() if r.state == "paused")
        if any(freed[d] + idle[d] < n for d, n in need.items()):
            return False
        self._yielded.pop(m.name, None)  # m waits for no one now (no cycle of models holding back)
        for c in order:
            if self.slo is not None:
                keep = set(map(id, self.slo.keeps(c, self._spare(m, c))))
                move = self._movers(c, keep)
                for req in reversed(list(c.running.values())):
                    if id(req) not in keep and id(req) not in move:
                        self._preempt(c, req, plan)
                self._pause(c, plan)
                for req in list(c.paused.values()):
                    if id(req) in move:  # their blocks go to host memory: cheaper than recomputing them
                        self._offload(c, req, plan)
            elif self.keeps_kv:
                self._pause(c, plan)
            else:
                for req in reversed(list(c.running.values())):
                    self._preempt(c, req, plan)
            if self.slo is None:  # the slo policy orders by slack: a stopped model need not hold back
                self._yielded[c.name] = m.name
            c.stopped_at = now
            self._epoch += 1
            self.switches += 1
            found = self._victims(m, self._start_need(m), set(), evict_waiting=True)
            if found is not None and not found[1]:
                break
        return True

    def _movers(self, c: ModelState, keep: set[int]) -> set[int]:
        """Slo policy: running requests of ``c`` (being stopped, not kept on the devices) whose blocks
        move to host memory instead of being dropped, the dearest to recompute per byte first, while
        the host budget allows and the move is the cheaper one."""
        if not self.kv_host:
            return set()
        assert self.slo is not None  # the slo policy's
        cost = self.slo.costs[c.name]
        reqs = sorted((r for r in c.running.values() if id(r) not in keep), reverse=True,
                      key=lambda r: cost.prefill(r.prompt_len + c.steps - r.joined) / max(r.blocks, 1))
        move, promised = set(), 0
        for r in reqs:
            if self._may_offload(c, r, promised):
                move.add(id(r))
                promised += self._host_bytes(c, r)
        return move

    def _spare(self, m: ModelState, c: ModelState) -> dict[int, int]:
        """Bytes per device left once ``c`` is stopped (its weights and caches gone) and ``m`` has
        started, less room for one more model's weights: what a stopped request may keep."""
        need = self._start_need(m)
        other = max((w for o in self.models.values() if not o.on_device and o.has_work and o is not m
                     for w in o.weights), default=0)
        return {d: self.free_bytes(d) + w + bb * sum(r.blocks for r in c.running.values()) - need.get(d, 0) - other
                for d, w, bb in zip(c.devices, c.weights, c.block_bytes)}

    def _pause(self, m: ModelState, plan: StepPlan) -> None:
        """Stop every running request of ``m`` and evict its weights; the requests' KV blocks stay
        booked on its devices (``steps`` stands still while it is off them, so each resumes with the
        tokens it had made)."""
        for req in m.running.values():
            req.state = "paused"
        m.paused, m.running = m.running, {}
        plan.paused.extend(m.paused)
        self._set_offloaded(m)
        plan.evictions.append(m.name)

    def _yielding(self, m: ModelState) -> bool:
        """Does ``m`` hold back for the model it was preempted for (still not on its devices)?"""
        other = self._yielded.get(m.name)
        if other is None:
            return False
        o = self.models.get(other)
        if o is not None and o.has_work:
            return True
        del self._yielded[m.name]  # it was removed, or its work ended before it got in
        return False

    def _can_start(self, m: ModelState) -> bool:
        """Could m's head request start now, evicting only models with nothing running?"""
        if m.stuck_start == self._epoch:
            return False
        ok = self._can_start_now(m)
        if not ok:
            m.stuck_start = self._epoch
        return ok

    def _can_start_now(self, m: ModelState) -> bool:
        need = self._start_need(m)
        if not self.counts_bytes and not m.on_device and not self._slot_possible(m):
            return False
        return self._victims(m, need, set(), evict_waiting=True) is not None

    def _slot_possible(self, m: ModelState) -> bool:
        return all(len(self.on_device[d]) < self.config.max_loaded or
                   any(not c.running and not c.pinned for c in self.on_device[d].values()) for d in m.devices)

    def _memory_may_come(self, m: ModelState) -> bool:
        """Will memory that ``m`` lacks come without failing anything? Running requests beside it end,
        or (colocation) a share below the budget grows: the engine's link asks training for what the
        work needs before the next step."""
        return self._busy_near(m) or any(self.shares[d] < self.budgets[d] for d in m.devices)

    def _busy_near(self, m: ModelState) -> bool:
        """Does any other model on m's devices have running requests (memory that will be freed)?"""
        return any(c.running for d in m.devices for c in self.on_device[d].values() if c is not m)

    def _cannot_load_reason(self, m: ModelState) -> str:
        pinned = sorted({c.name for d in m.devices for c in self.on_device[d].values() if c.pinned})
        return (f"model {m.name!r} ({sum(m.weights)} bytes on devices {list(m.devices)}) cannot be loaded: "
                f"the budget is {list(self.budgets[d] for d in m.devices)} bytes and pinned models "
                f"({', '.join(pinned) or 'none'}) hold the rest")

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.config.block_tokens)

    def _start_need(self, m: ModelState) -> dict[int, int]:
        """Bytes per device ``m`` needs to start: its weights (when not on its devices, and they
        count) and the blocks of its head request (to resume paused requests: those of theirs that are in
        host memory; the others are booked)."""
        blocks = self._host_blocks(m) if m.paused else self._blocks_at_start(m.waiting[0])
        if m.on_device or not self.counts_bytes:
            return {d: blocks * bb for d, bb in zip(m.devices, m.block_bytes)}
        return {d: blocks * bb + w for d, bb, w in zip(m.devices, m.block_bytes, m.weights)}

    def _blocks_at_start(self, req: SchedRequest) -> int:
        """Blocks a waiting request needs to start: its prompt, and what it made before a preemption."""
        return self._blocks(req.prompt_len + req.done)

    def _kv_need(self, m: ModelState, blocks: int) -> dict[int, int]:
        return {d: blocks * bb for d, bb in zip(m.devices, m.block_bytes)}

    def _room(self, m: ModelState) -> int:
        """How many more KV blocks of ``m`` fit now on all its devices."""
        free, devices, block_bytes = self.free, m.devices, m.block_bytes
        room = free[devices[0]] // block_bytes[0]
        for i in range(1, len(devices)):
            room = min(room, free[devices[i]] // block_bytes[i])
        return room

    def _fits(self, need: dict[int, int]) -> bool:
        return all(n <= self.free[d] for d, n in need.items())

    def _fits_blocks(self, m: ModelState, blocks: int) -> bool:
        """``_fits(_kv_need(m, blocks))`` without the dict."""
        free = self.free
        for d, bb in zip(m.devices, m.block_bytes):
            if blocks * bb > free[d]:
                return False
        return True

    def _take_blocks(self, m: ModelState, blocks: int) -> None:
        if blocks < 0:  # memory freed: what could not start may start now (taking it changes nothing)
            self._epoch += 1
        kv, free = self.kv_used, self.free
        for d, bb in zip(m.devices, m.block_bytes):
            n = blocks * bb
            kv[d] += n
            free[d] -= n
