"""The runtime memory options of the cost model (``computron train``'s: ZeRO-1 sharding only the
moments, the pipeline keeping its outputs, the step's gradient transients) against hand computations."""

import random
from dataclasses import replace

import pytest

from computron.planner import costs
from computron.planner.costs import Assumptions
from computron.planner.estimate import MemoryTerms, max_layers, memory_terms, stage_memory
from computron.planner.model import TransformerShape

TRAINER = Assumptions(bytes_per_param=18, zero_shards_master=False, keep_pipeline_outputs=True, step_transients=True)
# 4 layers of 1e6 parameters, 1e7 bytes of activations each; the last stage's loss 3e8 bytes, its
# output (logits) 1e8 bytes a micro-batch
HEAD = MemoryTerms(1e6, 0.0, 1e7, 0.0, 0.0, 3e8, out_mb=1e8, pipelined=True)


def test_zero1_without_sharded_master_keeps_every_fp32_master():
    """18 bytes: bf16 weight 2 + fp32 gradient 4 + fp32 master 4 + moments 8/dp (Megatron: (4 + 8)/dp)."""
    assert costs.state_bytes(1e9, 4, 1, TRAINER) == pytest.approx((2 + 4 + 4 + 8 / 4) * 1e9)
    assert costs.state_bytes(1e9, 4, 1, Assumptions(bytes_per_param=18)) == pytest.approx((2 + 4 + 12 / 4) * 1e9)
    assert costs.state_bytes(1e9, 4, 0, TRAINER) == pytest.approx(18e9)


def test_last_stage_keeps_every_output_and_concatenates_them():
    """states 4e6*18 = 7.2e7; by the last backward 7.2e7 + 4e7 + 3e8 + 8*1e8 = 1.212e9; at the step's
    end the 8 outputs and their concatenation: 7.2e7 + 1.6e9."""
    assert stage_memory(HEAD, 4, 1, 8, 1, 1, 0, TRAINER) == pytest.approx(1.672e9)
    assert stage_memory(HEAD, 4, 1, 2, 1, 1, 0, TRAINER) == pytest.approx(7.2e7 + 4e7 + 3e8 + 2e8)
    assert stage_memory(HEAD, 4, 1, 8, 1, 1, 0, Assumptions(bytes_per_param=18)) == pytest.approx(7.2e7 + 4e7 + 3e8)


def test_step_transients_without_pipeline():
    """P = 4e6, activations 4e5. dp=2 ZeRO-1, one micro-batch: states (2+4+4+4)P = 5.6e7, of which the
    gradients 1.6e7 are not yet there while it runs (4.04e7); the whole bf16 gradient at its backward's
    end 5.6e7 + 8e6; the all-reduce's flat copy 5.6e7 + 1.6e7 = 7.2e7, the peak. dp=1, two micro-batches:
    18P = 7.2e7 plus the bf16 gradient 8e6."""
    t = MemoryTerms(1e6, 0.0, 1e5, 0.0, 0.0, 0.0)
    assert stage_memory(t, 4, 1, 1, 1, 2, 1, TRAINER) == pytest.approx(7.2e7)
    assert stage_memory(t, 4, 1, 2, 1, 1, 0, TRAINER) == pytest.approx(8.0e7)
    big = MemoryTerms(1e6, 0.0, 1e8, 0.0, 0.0, 0.0)  # activations 4e8 dominate; one micro-batch: no gradients
    assert stage_memory(big, 4, 1, 1, 1, 2, 1, TRAINER) == pytest.approx(5.6e7 - 1.6e7 + 4e8)
    # the same with the pipeline's outputs not kept (the trainer where torch lets it): the transients alone
    lean = replace(TRAINER, keep_pipeline_outputs=False)
    assert stage_memory(t, 4, 1, 1, 1, 2, 1, lean) == pytest.approx(7.2e7)
    assert stage_memory(big, 4, 1, 1, 1, 2, 1, lean) == pytest.approx(5.6e7 - 1.6e7 + 4e8)


def test_graphed_steps_keep_the_graphs_pool_beside_the_eager_transients():
    """Graphed (no pipeline), the private pool holds one micro-batch's activations 4e8 and its bf16
    gradient 2P = 8e6 through the step, beside the states (14P = 5.6e7 at dp=2 ZeRO-1, gradients held
    throughout) and, with dp > 1, the all-reduce's flat fp32 copy 4P = 1.6e7; a pipeline is eager."""
    graphed = replace(TRAINER, graphed_steps=True)
    big = MemoryTerms(1e6, 0.0, 1e8, 0.0, 0.0, 0.0)
    assert stage_memory(big, 4, 1, 1, 1, 2, 1, graphed) == pytest.approx(5.6e7 + 4e8 + 8e6 + 1.6e7)
    assert stage_memory(big, 4, 1, 2, 1, 1, 0, graphed) == pytest.approx(7.2e7 + 4e8 + 8e6)
    piped = MemoryTerms(1e6, 0.0, 1e8, 0.0, 0.0, 0.0, pipelined=True)
    assert stage_memory(piped, 4, 1, 2, 1, 2, 1, graphed) == stage_memory(piped, 4, 1, 2, 1, 2, 1, TRAINER)
    # without the trainer's other runtime peaks (Megatron's defaults), graphs alone still add the pool
    assert stage_memory(big, 4, 1, 2, 1, 1, 0, Assumptions(bytes_per_param=18, graphed_steps=True)) == \
        pytest.approx(7.2e7 + 4e8 + 8e6)


def test_memory_terms_output_of_the_last_pipeline_stage_only():
    m = TransformerShape("g", "gpt", layers=4, hidden=1024, heads=16, ffn=4096, vocab=50000, seq_len=512,
                         global_batch=4)
    assert memory_terms(m, 2, 4, 1, 2, False, 1e7).out_mb == pytest.approx(2 * 4 * 512 * 50000 / 2)
    assert memory_terms(m, 2, 4, 0, 2, False, 1e7).out_mb == 0.0
    assert memory_terms(m, 2, 4, 0, 1, False, 1e7).out_mb == 0.0


def test_max_layers_exact_with_runtime_peaks():
    """max_layers stays the largest n that fits when the stage's peak is the largest of several."""
    rng = random.Random(5)
    for _ in range(300):
        t = MemoryTerms(rng.uniform(1e6, 1e9), rng.uniform(0, 1e9), rng.uniform(0, 5e8), rng.uniform(0, 1e9),
                        rng.uniform(0, 1e8), rng.uniform(0, 2e9), rng.uniform(0, 1e9), rng.random() < 0.5)
        L, v, mb, dp = rng.randint(1, 100), rng.choice([1, 2]), rng.randint(1, 16), rng.choice([1, 2, 8])
        inflight, zero1 = rng.randint(1, 20), rng.random() < 0.5
        usable = rng.uniform(0, 2) * stage_memory(t, L, inflight, mb, v, dp, zero1, TRAINER)
        fit = [n for n in range(L + 1) if stage_memory(t, n, inflight, mb, v, dp, zero1, TRAINER) <= usable]
        assert max_layers(t, usable, L, inflight, mb, v, dp, zero1, TRAINER) == (max(fit) if fit else 0)


def test_graphed_pipeline_stages_keep_a_pool_per_slot():
    """A graphed stage keeps one pool per slot (``schedule.graph_slots``): the slots count as the
    micro-batches in flight, each keeps its chunk's 16-bit gradient, and on the last stage the static
    logits and their gradient. Last stage, 1F1B, 3 slots, n=4, 8 micro-batches: states 7.2e7,
    activations 3*4e7 + the loss 3e8, the 8 kept outputs 8e8, the pools' gradients 2*3*4e6 = 2.4e7,
    the logits 2*3*1e8 = 6e8."""
    from computron.planner.schedule import graph_slots, inflight_closed_form

    graphed = replace(TRAINER, graphed_steps=True)
    assert graph_slots(4, 1, 8, 1) == (3, 3, 3) and inflight_closed_form(4, 1, 8, 1) == 3
    want = 7.2e7 + 1.2e8 + 3e8 + 8e8 + 2.4e7 + 6e8
    assert stage_memory(HEAD, 4, 3, 8, 1, 1, 0, graphed, slots=(3, 3, 3)) == pytest.approx(want)
    # interleaved, the chunks peak at different times: 4 + 2 slots on stage 0 of 2, above its 5 in flight;
    # the embedding (fixed parameters, no logits) kept by the first chunk's 4 slots
    assert graph_slots(2, 2, 8, 0) == (6, 4, 2) and inflight_closed_form(2, 2, 8, 0) == 5
    first = MemoryTerms(1e6, 5e5, 1e7, 0.0, 0.0, 0.0, pipelined=True)
    lean = replace(graphed, keep_pipeline_outputs=False, step_transients=False)
    eager = stage_memory(first, 4, 5, 8, 2, 1, 0, replace(lean, graphed_steps=False))
    got = stage_memory(first, 4, 5, 8, 2, 1, 0, lean, slots=(6, 4, 2))
    assert got - eager == pytest.approx(1e7 * 2 + 2 * (6 * 2 * 1e6 + 4 * 5e5))
