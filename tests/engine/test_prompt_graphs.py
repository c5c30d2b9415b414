"""Which prompt chunks replay a captured graph (engine/prompt_graphs.py; the graphs' bits against
eager passes are held on the GPU: tests/gpu/test_gpu_exact_serving.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from verispec.engine import prompt_graphs
from verispec.engine.prompt_graphs import PROMPT_BUCKETS, bucket_for, capture_prompt_graphs, prompt_graph_reason


@pytest.mark.parametrize("tokens,bucket", [(1, 16), (16, 16), (17, 32), (257, 384), (1024, 1024), (1025, None)])
def test_a_chunk_runs_in_the_smallest_bucket_that_holds_it(tokens, bucket):
    assert bucket_for(tokens, list(PROMPT_BUCKETS)) == bucket


def runner(prompt_kernel=True, recurrent=(), peers=None):
    return SimpleNamespace(prompt_kernel=prompt_kernel, pools=SimpleNamespace(recurrent_layers=list(recurrent)),
                           peers=peers)


def test_only_passes_whose_rows_are_independent_replay_graphs():
    assert prompt_graph_reason(runner(), 2048) is None
    assert "fast numerics" in prompt_graph_reason(runner(prompt_kernel=False), 2048)
    assert "recurrent" in prompt_graph_reason(runner(recurrent=[0]), 2048)
    assert "tensor parallelism" in prompt_graph_reason(runner(peers=object()), 2048)
    assert "the smallest graph is 16" in prompt_graph_reason(runner(), PROMPT_BUCKETS[0] - 1)


def test_no_graphs_where_they_cannot_run_or_no_bucket_fits_the_step():
    assert capture_prompt_graphs(runner(prompt_kernel=False), 2048, 8, 64, ()) is None
    assert capture_prompt_graphs(runner(), PROMPT_BUCKETS[0] - 1, 8, 64, ()) is None


class FakeCapture:
    def __init__(self, runner, num_seqs, num_tokens, table_width, capture, pool):
        self.num_seqs, self.num_tokens = num_seqs, num_tokens
        self.call = SimpleNamespace(pool=lambda: pool)


def test_passes_of_several_sequences_replay_graphs_up_to_the_batched_limits(monkeypatch):
    """Shapes captured: every chunk bucket for one sequence; for 2, 4, 8 sequences the buckets up
    to MAX_BATCHED_CHUNK within MAX_BATCHED_ROWS rows; a pass takes the smallest shape that holds it."""
    monkeypatch.setattr(prompt_graphs, "_CapturedPrompt", FakeCapture)
    graphs = prompt_graphs.PromptGraphs(runner(), 1024, 6, 64, ())
    assert graphs.batch_sizes == [1, 2, 4]  # up to the engine's max_num_seqs
    assert graphs.get(1, 1000).num_tokens == 1024
    assert (graphs.get(3, 100).num_seqs, graphs.get(3, 100).num_tokens) == (4, 128)
    assert graphs.get(2, prompt_graphs.MAX_BATCHED_CHUNK + 1) is None  # long chunks: eager
    assert graphs.get(5, 16) is None  # more sequences than any bucket
    assert graphs.longest_batched == prompt_graphs.MAX_BATCHED_CHUNK
    assert all(b * t <= prompt_graphs.MAX_BATCHED_ROWS for b, t in graphs.passes if b > 1)
    eight = prompt_graphs.PromptGraphs(runner(), 1024, 64, 64, ())
    assert eight.batch_sizes[-1] == 8 and eight.get(8, 512) is not None and eight.get(9, 16) is None
