"""CUDA graphs of a model's decode step: one per batch-size bucket, replayed instead of launching
every kernel of every layer from Python.

A graph bakes in the addresses it read at capture: the weights (so graphs are kept only while
the weights stay at the same address; an eviction and a reload at the same place keep them, a
move drops them), the arena's KV pool (fixed for the executor's life), and its own static
input buffers, which each step refills with one host-to-device copy (from a pinned staging
buffer that is refilled only once that copy has left it: a step may be queued behind another
without the host waiting for the first, the workers' run-ahead). A batch of B sequences runs
in the smallest bucket >= B; padding rows have slot -1 (their keys and values are written
nowhere) and length 0 (their attention reads nothing), and their logits are dropped.
"""

from __future__ import annotations

import time

import torch

from ..models.kvcache import KVPool
from ..models.transformer import AttnBatch
from .buckets import bucket_of, buckets
from .runner import ModelRunner


class DecodeGraph:
    def __init__(self, runner: ModelRunner, pool: KVPool, bucket: int, width: int, device: torch.device, mempool,
                 side: torch.cuda.Stream, warm_up: bool = True):
        self.bucket, self.width = bucket, width
        t0 = time.perf_counter()
        n = bucket * (4 + width)
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=True)
        self.staged = torch.cuda.Event()  # the last copy out of ``host`` ended
        self.inputs = torch.zeros(n, dtype=torch.int64, device=device)
        ids, pos, slots, lens = self.inputs[: 4 * bucket].view(4, bucket)
        slots.fill_(-1)
        tables = self.inputs[4 * bucket:].view(bucket, width)
        rows = torch.arange(bucket + 1, device=device)
        # Kept for the graph's life: it reads these tensors' memory at every replay.
        self.batch = batch = AttnBatch(k=pool.k, v=pool.v, slots=slots, block_tables=tables, seq_lens=lens,
                                       query_lens=torch.ones(bucket, dtype=torch.int64, device=device),
                                       cu_query=rows, last=rows[:bucket], decode=True)
        # Captured on a side stream with the graph's own calls, not ``torch.cuda.graph``: that one
        # synchronises the whole device (waiting for another model's swap-in or a step run ahead) and
        # empties PyTorch's device and pinned-host caches (the next prefill then allocates from the
        # driver again). Nothing here needs either: the warm-up runs in stream order before the capture,
        # the capture executes nothing, and the caller's stream waits for the side stream.
        side.wait_stream(torch.cuda.current_stream(device))
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            t1 = time.perf_counter()
            for _ in range(2 if warm_up else 0):  # compile and tune every kernel of this shape, once
                runner.forward(ids, pos, batch)
            warm = time.perf_counter() - t1
            self.graph.capture_begin(pool=mempool, capture_error_mode="thread_local")
            try:
                self.logits = runner.forward(ids, pos, batch)
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
        # host seconds (the warm-up may still be running on the device): all of it, and all but the
        # warm-up, which is what a capture again after the weights moved costs
        self.capture_s = time.perf_counter() - t0
        self.recapture_s = self.capture_s - warm

    def _fill(self, h, ids, pos, slots, lens) -> None:
        n, b = self.bucket, len(ids)
        fields = h.reshape(4, n)
        for row, values, fill in zip(fields, (ids, pos, slots, lens), (0, 0, -1, 0)):
            row[:b] = values
            row[b:] = fill

    def _tables(self, h, tables: list[list[int]]) -> None:
        t = h.reshape(self.bucket, self.width)
        for i, blocks in enumerate(tables):
            t[i, : len(blocks)] = blocks

    def run(self, ids: list[int] | torch.Tensor, pos: list[int], slots: list[int], lens: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        """Logits [len(pos), vocab] of one decode step of these sequences; ``ids``: their tokens, from
        the host or (a tensor) on the device, as the step before sampled them. Table entries past a
        sequence's blocks are left as they were: the kernels never read past its length."""
        self.staged.synchronize()  # the last refill's copy has left the staging buffer (at once, usually)
        fed = isinstance(ids, torch.Tensor)
        h = self.host.numpy()
        self._fill(h[: 4 * self.bucket], [0] * len(pos) if fed else ids, pos, slots, lens)
        self._tables(h[4 * self.bucket:], tables)
        self.inputs.copy_(self.host, non_blocking=True)
        self.staged.record()
        if fed:
            self.inputs[: len(pos)].copy_(ids)
        self.graph.replay()
        return self.logits[: len(pos)]

    def plan_run(self, first: list[int], pos: list[list[int]], slots: list[list[int]], lens: list[list[int]],
                 tables: list[list[int]]) -> None:
        """Stage a run of ``len(pos)`` decode steps on the device in one copy: each step's positions,
        cache slots and lengths, the block tables (holding every block of the run), the first
        step's tokens. ``run_planned`` then needs no host data but the tokens, which stay on the device."""
        n, k = 4 * self.bucket, len(pos)
        size = k * n + self.bucket * self.width
        if getattr(self, "run_host", None) is None or self.run_host.numel() < size:
            # the last run's copy was waited for (its tokens were read back) before this one is refilled
            self.run_host = torch.zeros(size, dtype=torch.int64, pin_memory=True)
            self.run_dev = torch.zeros(size, dtype=torch.int64, device=self.inputs.device)
        h = self.run_host.numpy()
        for j in range(k):
            self._fill(h[j * n:(j + 1) * n], first if j == 0 else [0] * len(first), pos[j], slots[j], lens[j])
        self._tables(h[k * n: size], tables)
        self.run_dev[:size].copy_(self.run_host[:size], non_blocking=True)
        self.inputs[n:].copy_(self.run_dev[k * n: size])
        self.run_b = len(first)

    def run_planned(self, step: int, tokens: torch.Tensor | None) -> torch.Tensor:
        """Logits of step ``step`` of the planned run; ``tokens`` (on the device): the previous step's
        tokens, fed as this step's input (None: the first step's, staged by ``plan_run``)."""
        n = 4 * self.bucket
        self.inputs[:n].copy_(self.run_dev[step * n:(step + 1) * n])
        if tokens is not None:
            self.inputs[: tokens.shape[0]].copy_(tokens)
        self.graph.replay()
        return self.logits[: self.run_b]


class DecodeGraphs:
    """A model's decode graphs for the weights at one address. A bucket captured again after the
    weights moved skips the warm-up: its kernels were compiled and tuned, on the same side stream,
    by its first capture."""

    def __init__(self, max_batch: int, width: int, device: torch.device):
        self.sizes, self.width, self.device = buckets(max_batch), width, device
        self.address: int | None = None
        self.graphs: dict[int, DecodeGraph] = {}
        self.mempool = None
        self.side: torch.cuda.Stream | None = None  # every capture's stream
        self.warm: set[int] = set()  # buckets captured before (at any address)
        self.captures, self.capture_s = 0, 0.0  # graphs captured so far, and the seconds it took
        self.recapture_s = 0.0  # of which all but the warm-ups: what captures again would cost

    def ready(self, batch: int, address: int) -> bool:
        """Is there a graph for ``batch`` rows at ``address`` (``get`` would capture none)?"""
        bucket = bucket_of(batch, self.sizes)
        return bucket is not None and address == self.address and bucket in self.graphs

    def get(self, runner: ModelRunner, pool: KVPool, batch: int, address: int) -> DecodeGraph | None:
        bucket = bucket_of(batch, self.sizes)
        if bucket is None:
            return None
        if address != self.address:  # the weights moved: every graph points at the old place
            self.graphs.clear()
            self.address, self.mempool = address, torch.cuda.graph_pool_handle()
        g = self.graphs.get(bucket)
        if g is None:
            if self.side is None:
                self.side = torch.cuda.Stream(self.device)
            g = self.graphs[bucket] = DecodeGraph(runner, pool, bucket, self.width, self.device, self.mempool,
                                                  self.side, warm_up=bucket not in self.warm)
            self.warm.add(bucket)
            self.captures += 1
            self.capture_s += g.capture_s
            self.recapture_s += g.recapture_s
        return g
