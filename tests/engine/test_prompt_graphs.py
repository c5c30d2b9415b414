"""Which prompt chunks replay a captured graph (engine/prompt_graphs.py; the graphs' bits against
eager passes are held on the GPU: tests/gpu/test_gpu_exact_serving.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

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
    assert capture_prompt_graphs(runner(prompt_kernel=False), 2048, 64, ()) is None
    assert capture_prompt_graphs(runner(), PROMPT_BUCKETS[0] - 1, 64, ()) is None
