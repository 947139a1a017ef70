"""Run-ahead: a worker starts the next decode step of a steady batch before the engine asks for it.

Lives in a worker process (``worker_loop``), on its device: ``RunAheadExecutor`` is the
in-process executor that a worker serves, plus one step run ahead. The ``inprocess`` executor on a
CUDA GPU is one too (``make_executor``, with ``run_ahead``): the engine's thread drives it, and the
next step is queued on the device before this step's tokens are read back, so the GPU computes
while the host takes the tokens in and plans (on the CPU, starting a step computes it: nothing to
gain, the plain executor serves).

Why. The workers executor crosses a process boundary at every engine step: the step goes to the
worker as a message and its tokens come back as one (two pickles, two pipe writes, two process
wake-ups: about 200 µs a call, most of it the wake-ups and the sends, measured on an H100 host
and on the CPU). The in-process executor pays none of that, and with single decode steps the
device would idle through it. The engine's scheduler knows when its next plan will most likely be
the same batch one token on (``StepPlan.repeats``: a steady decode batch in which no request
makes its last token) and says so in the step (``ExecuteBatch.ahead``). The worker then starts
that next step itself, each sequence fed the token it just sampled, still on the device (as runs
of several decode steps do), so the device computes step n+1 while step n's tokens travel to the
engine and the engine plans step n+1.

Used or dropped. When the engine's next step is that one (same model, same requests in the same
order, each one token on with the token the worker sampled), the step run ahead is its answer, and
the step after it is started before those tokens are read back (on a GPU, queued behind it: the
device never waits for the host; on the CPU, where starting a step is computing it, just after
the answer is sent, ``run_ahead``). Anything else drops it first: a different step (a request
ended by EOS, a stop string or an abort, one joined, a run of several steps) and every other
call (free, apply, resize, status, ...), which also waits for its device work to end before
memory changes hands. The executor drops it itself at the start of every protocol call but a step
(``register`` aside: it runs on another thread and touches no device memory; ``unregister`` of a
model not on the device neither), so whoever drives it (the worker loop, which also drops before
every other message, or the engine in process) cannot miss one. Dropping leaves no trace: the KV blocks taken for it are released, every
generator it drew from is set back (a seeded request draws the same numbers as if it never ran;
the default generator too), and the one cache slot per sequence it wrote lies past the
sequence's length until the real step writes it again. Hence every answer is the one the
in-process executor gives, bit for bit: the same kernels on the same batch (the same CUDA graph
or eager forward) and the same sampler.

Several models a step (``models_per_step``): a step of several models' steady decode batches is run
ahead as a whole, each model's step on a stream of its own as ``_run_together`` runs them, once every
one has its decode graph captured; the next step uses it only if it is exactly those batches (in any
order), each one token on, and drops all of it otherwise.

Not run ahead (served as before): rows whose sampling needs the host between steps (penalties,
min_tokens, a logit bias, logprobs: ``inprocess.hosted``), a trace, a copy in flight, prefills,
runs of several steps, sharded models (every rank would need the token), a step of several batches
any one of which cannot be. Counters in ``status().stats``: ``run_ahead_used``, ``run_ahead_dropped``
(steps, whatever the number of batches in them).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..memory.arena import OutOfMemory
from ..messages import ExecuteBatch, ExecutorStatus, SeqInput, StepResult
from ..models.kvcache import paged_batch
from .inprocess import InProcessExecutor, _Seq, hosted
from .sampling import Sampler

log = logging.getLogger("computron.workers")


@dataclass(eq=False)
class _Ahead:
    """A step run ahead: the batch one token on, its sampled tokens still on the device."""

    model: str
    req_ids: list[str]
    past: list[int]  # each sequence's cached tokens before it (the position of its input token)
    inputs: list[int] | None  # the tokens it was fed (on the host once the step before was read back)
    tokens: torch.Tensor  # what it sampled, on the device
    blocks: list[tuple[_Seq, int]]  # each sequence and how many KV blocks it held before
    rng: list[tuple[torch.Generator, torch.Tensor]]  # the generators it drew from, and their states before
    compute_s: float = 0.0
    host: torch.Tensor | None = None  # GPU: the tokens' pinned copy, ready at ``done``
    start: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None


class RunAheadExecutor(InProcessExecutor):
    """The in-process executor of a worker, plus one decode step run ahead (see the module)."""

    def __init__(self, config, index: int = 0, world: int = 1):
        super().__init__(config, index, world)
        # The order: on a GPU starting a step does not compute it, so the next one is queued before a
        # step's tokens are read back; on the CPU it is run once the answer is sent (``run_ahead``).
        self.eager = self.device.type == "cuda"
        # The step run ahead, neither used nor dropped yet: one entry per batch (several models a step
        # run ahead together, ``models_per_step``); empty when there is none.
        self._ahead: list[_Ahead] = []
        # CPU: what to run ahead once the answer is sent (the batches and the tokens each fed)
        self._next: tuple[list[ExecuteBatch], list[list[int]]] | None = None
        self.used = self.dropped = 0
        self._failed = False

    # ---- the protocol's step -------------------------------------------------------------------
    def execute(self, batches: list[ExecuteBatch]) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(self._step(batches))
        except Exception as e:
            fut.set_exception(e)
        return fut

    def _step(self, batches: list[ExecuteBatch]) -> StepResult:
        aheads, self._ahead, self._next = self._ahead, [], None
        # the engine expects the step after this one, and each batch's can be fed (one batch a model)
        follow = bool(batches) and len({b.model for b in batches}) == len(batches) and \
            all(self._eligible(b) for b in batches)
        used = self._matching(aheads, batches)
        if used is not None:
            self.used += 1
            if len(used) > 1 and self.device.type == "cuda":  # they ran on streams of their own
                self.steps_together += 1
            # queued behind the steps run ahead on the device
            nxt = self._launch_all(batches, [a.tokens for a in used]) if follow and self.eager else []
            try:
                tokens = [self._read(a) for a in used]
            except BaseException:
                self._drop_step(nxt)
                raise
            for n, t in zip(nxt, tokens):
                n.inputs = t
            result = StepResult(tokens={rid: t for a, ts in zip(used, tokens) for rid, t in zip(a.req_ids, ts)},
                                compute_s={a.model: a.compute_s for a in used})
            self._poll_loads(result)
        else:
            self._drop_step(aheads)
            result = super().execute(batches).result()
            tokens = [[result.tokens[s.req_id] for s in b.seqs] for b in batches] if follow else None
            nxt = self._launch_all(batches, tokens) if follow and self.eager else []
        self._ahead = nxt
        if follow and not self.eager:
            self._next = (batches, tokens)
        return result

    def run_ahead(self) -> None:
        """After the step's answer was sent: on the CPU, run the next step ahead now (a GPU queued it)."""
        if self._next is not None:
            batches, tokens = self._next
            self._next = None
            self._ahead = self._launch_all(batches, tokens)

    def drop_ahead(self) -> None:
        """Before any other call: the step run ahead is not what comes next; undo it."""
        self._next = None
        aheads, self._ahead = self._ahead, []
        self._drop_step(aheads)

    # ---- running ahead -------------------------------------------------------------------------
    def _eligible(self, b: ExecuteBatch) -> bool:
        """May the step after ``b`` be run ahead (the engine expects it, and no row needs the host)?"""
        if not b.ahead or b.steps != 1 or b.trace:
            return False
        model, res = self.models.get(b.model), self.resident.get(b.model)
        if model is None or res is None or res.swap is not None or not model.answers or model.runner.links is not None:
            return False
        return all(s.past > 0 and len(s.tokens) == 1 and s.share is None and s.prompt_logprobs is None
                   and not hosted(s.params) and s.req_id in self.seqs for s in b.seqs)

    def _matching(self, aheads: list[_Ahead], batches: list[ExecuteBatch]) -> list[_Ahead] | None:
        """The steps run ahead in the order of ``batches``, if they are exactly this step (each batch
        one of them, one token on), else None."""
        if not aheads or len(aheads) != len(batches):
            return None
        by_model = {a.model: a for a in aheads}
        used = [by_model.get(b.model) for b in batches]
        if len(by_model) != len(aheads) or any(a is None or not self._matches(a, b) for a, b in zip(used, batches)):
            return None
        return used

    def _launch_all(self, batches: list[ExecuteBatch], firsts: list) -> list[_Ahead]:
        """Start the step after each of ``batches`` (``_launch``), all or none. Several models' steps
        each go on a stream of their own, as a step of them does (``_run_together``), once every
        one's decode graph is at hand: capturing one while the others run is never done."""
        if len(batches) == 1:
            a = self._launch(batches[0], firsts[0])
            return [] if a is None else [a]
        cuda = self.device.type == "cuda"
        if cuda and not all(self._graph_ready(b) for b in batches):
            return []
        main = torch.cuda.current_stream(self.device) if cuda else None
        if cuda:
            while len(self._streams) < len(batches):
                self._streams.append(torch.cuda.Stream(self.device))
        out: list[_Ahead] = []
        try:
            for i, (b, first) in enumerate(zip(batches, firsts)):
                if cuda:
                    stream = self._streams[i]
                    stream.wait_stream(main)  # after every step before (and the tokens it feeds on)
                    if isinstance(first, torch.Tensor):
                        first.record_stream(stream)  # made on another stream: kept until this one has read it
                    with torch.cuda.stream(stream):
                        a = self._launch(b, first)
                else:
                    a = self._launch(b, first)
                if a is None:
                    break
                out.append(a)
        except Exception as e:  # noqa: BLE001 -- as in _launch: running ahead never fails the step it follows
            log.warning("device %d: running a step of %d models ahead failed: %s: %s", self.index, len(batches),
                        type(e).__name__, e)
            a = None
        finally:
            if cuda:
                for stream in self._streams[:len(batches)]:
                    main.wait_stream(stream)
        if a is None:  # all or none
            for done in reversed(out):  # last first: generators they share go back to the first's state
                self._drop(done)
            return []
        return out

    def _graph_ready(self, b: ExecuteBatch) -> bool:
        """Does ``b``'s model hold a decode graph for its batch at its weights' address (none to capture)?"""
        model, res = self.models[b.model], self.resident[b.model]
        return model.graphs is not None and model.graphs.ready(len(b.seqs), res.region.tensor.data_ptr())

    @staticmethod
    def _matches(a: _Ahead, b: ExecuteBatch) -> bool:
        if b.model != a.model or b.steps != 1 or b.trace or len(b.seqs) != len(a.req_ids) or a.inputs is None:
            return False
        return all(s.req_id == rid and s.past == p and s.tokens == [t] and s.share is None and s.prompt_logprobs is None
                   for s, rid, p, t in zip(b.seqs, a.req_ids, a.past, a.inputs))

    def _launch(self, b: ExecuteBatch, first: list[int] | torch.Tensor) -> _Ahead | None:
        """Start the step after ``b``: each sequence one position on, fed ``first`` (``b``'s tokens, on
        the host or the device). On a GPU only queued; on the CPU computed. None if it cannot be
        (its KV blocks do not fit: the scheduler has not booked them yet)."""
        name = b.model
        model, res = self.models[name], self.resident[name]
        runner = model.runner
        seqs = [self.seqs[s.req_id] for s in b.seqs]
        past = [s.past + 1 for s in b.seqs]
        kept = [(q, len(q.blocks)) for q in seqs]
        rng = self._generators(b, seqs)
        try:
            for s, p in zip(b.seqs, past):
                self._seq(model, SeqInput(s.req_id, [0], p, s.params))  # the block its token needs
            self._bind(name)  # allocating may have compacted the arena
            ids = [self._ids(q) for q in seqs]
            t0 = time.perf_counter()
            start = done = None
            if self.device.type == "cuda":
                start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            graph = None if model.graphs is None else \
                model.graphs.get(runner, model.pool, len(seqs), res.region.tensor.data_ptr())
            on_device = isinstance(first, torch.Tensor)
            if graph is not None:
                bt = self.block_tokens
                logits = graph.run(first, past, [blk[p // bt] * bt + p % bt for blk, p in zip(ids, past)],
                                   [p + 1 for p in past], ids)
            else:
                attn = paged_batch(model.pool, [(blk, p, 1) for blk, p in zip(ids, past)], self.device)
                fed = first if on_device else torch.tensor(first, dtype=torch.long).to(self.device, non_blocking=True)
                pos = torch.tensor(past, dtype=torch.long).to(self.device, non_blocking=True)
                logits = runner.forward(fed, pos, attn)
            params = [s.params for s in b.seqs]
            tokens = Sampler(params, logits.shape[-1], self.device)(logits, [q.generator for q in seqs])
        except Exception as e:  # noqa: BLE001 -- running ahead must never fail the step it follows
            self._undo(kept, rng)
            if not isinstance(e, OutOfMemory):  # a bug: said once, then the steps simply go on as before
                (log.debug if self._failed else log.warning)(
                    "worker for device %d: running a step ahead failed: %s: %s", self.index, type(e).__name__, e)
                self._failed = True
            return None
        a = _Ahead(name, [s.req_id for s in b.seqs], past, None if on_device else list(first), tokens,
                   kept, rng)
        if done is not None:
            a.host = torch.empty(len(past), dtype=torch.int64, pin_memory=True)
            a.host.copy_(tokens, non_blocking=True)
            a.start, a.done = start, done
            done.record()
        else:
            a.compute_s = time.perf_counter() - t0
        return a

    def _read(self, a: _Ahead) -> list[int]:
        """The tokens of a step run ahead, on the host (waiting for its device work, not for later steps)."""
        if a.done is None:
            return a.tokens.tolist()
        a.done.synchronize()
        a.compute_s = a.start.elapsed_time(a.done) / 1e3
        return a.host.tolist()

    def _generators(self, b: ExecuteBatch, seqs: list[_Seq]) -> list[tuple[torch.Generator, torch.Tensor]]:
        """The generators a step of ``b`` may draw from (``Sampler``), with their states now."""
        gens = [q.generator for q in seqs if q.generator is not None]
        if any(q.generator is None for q in seqs) and not all(s.params.greedy for s in b.seqs):
            gens.append(torch.cuda.default_generators[self.device.index if self.device.index is not None
                                                      else torch.cuda.current_device()]
                        if self.device.type == "cuda" else torch.default_generator)
        return [(g, g.get_state()) for g in gens]

    def _drop_step(self, aheads: list[_Ahead]) -> None:
        """Undo a step run ahead (each of its batches', the last first: a generator several drew from,
        the default one, goes back to its state before the first), counted once."""
        for a in reversed(aheads):
            self._drop(a)
        if aheads:
            self.dropped += 1

    def _drop(self, a: _Ahead) -> None:
        if a.done is not None:
            a.done.synchronize()  # its kernels may write KV blocks and read weights: done before memory moves
        self._undo(a.blocks, a.rng)

    def _undo(self, kept: list[tuple[_Seq, int]], rng: list[tuple[torch.Generator, torch.Tensor]]) -> None:
        """Back to the state before a step run ahead: generators, then the blocks it took (each
        sequence's blocks past those it held; a sequence freed or released since holds none)."""
        for g, state in rng:
            g.set_state(state)
        for q, n in kept:
            extra = q.blocks[n:]
            if extra:
                del q.blocks[n:]
                q.ids = None
                for region in extra:
                    self.arena.release(region)

    # ---- every other protocol call drops the step run ahead first --------------------------------
    # (on the caller's thread, the engine's or the worker loop's, as steps are; ``register`` runs on
    # another thread and touches neither the arena nor a sequence, so it leaves the step alone)
    def unregister(self, name: str) -> None:
        if name in self.resident:  # evicting frees its memory (a model not on the device: nothing to undo;
            self.drop_ahead()      # the engine's registration thread unregisters only such ones)
        super().unregister(name)

    def apply(self, change):
        self.drop_ahead()
        return super().apply(change)

    def wait_loads(self) -> dict[str, float]:
        self.drop_ahead()
        return super().wait_loads()

    def free(self, req_ids: list[str]) -> None:
        self.drop_ahead()
        super().free(req_ids)

    def resize(self, device: int, nbytes: int) -> int:
        self.drop_ahead()
        return super().resize(device, nbytes)

    def probe_link(self, name: str, repeats: int) -> list[float]:
        self.drop_ahead()
        return super().probe_link(name, repeats)

    def shutdown(self) -> None:
        self.drop_ahead()
        super().shutdown()

    # ---- status --------------------------------------------------------------------------------
    def status(self) -> ExecutorStatus:
        self.drop_ahead()  # as the worker loop does: the memory it reports holds no step run ahead
        st = super().status()
        st.stats.update(run_ahead_used=self.used, run_ahead_dropped=self.dropped)
        return st
