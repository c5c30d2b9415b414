"""`verispec bench --prefix-cache`: the three measurements come out, and what they count is what the
engine did (a repeated prompt reuses all its whole blocks but one token's; a conversation computes
fewer prompt tokens than it sends)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from verispec.cli import main

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_helpers import live_server  # noqa: E402


def test_prefix_bench_on_a_random_shape(tmp_path, capsys):
    rc = main(["bench", "--shape", "tiny", "--device", "cpu", "--prefix-cache", "--contexts", "40",
               "--gen-tokens", "8", "--repeats", "1", "--concurrency", "2", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rows = {r["test"]: r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    assert set(rows) == {"repeat", "conversation", "misses"}
    assert rows["repeat"]["cached_tokens"] == 32  # 40 tokens: two whole blocks of 16 (the last token computed)
    conversation = rows["conversation"]
    assert conversation["turns"] == 10 and conversation["rendering"] == "token ids"
    assert 0 < conversation["computed_tokens"] < conversation["prompt_tokens"]
    assert rows["misses"]["decode_tok_s"] > 0 and rows["misses"]["decode_tok_s_off"] > 0
    assert "conversation: prompt tokens computed" in (tmp_path / "bench.md").read_text()


def test_prefix_bench_over_http_reads_the_servers_cached_tokens(qwen3_dir, tmp_path, capsys):
    """Against a live server: the conversation's computed tokens come from usage.prompt_tokens_details."""
    from verispec.engine.engine import load_engine
    from verispec.server.app import create_app

    engine = load_engine(str(qwen3_dir), dtype="float32", device="cpu")
    with live_server(create_app(engine, "tiny-prefix")) as server:
        rc = main(["bench", "--url", server.url, "--prefix-cache", "--contexts", "60", "--gen-tokens", "6",
                   "--repeats", "1", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rows = {r["test"]: r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    assert set(rows) == {"repeat", "conversation"}
    assert rows["repeat"]["cached_tokens"] >= 16
    conversation = rows["conversation"]
    assert conversation["rendering"] == "HTTP chat" and conversation["turns"] >= 3  # until the context is full
    assert 0 < conversation["computed_tokens"] < conversation["prompt_tokens"]
    assert engine.prefix.stats.hit_tokens == sum([rows["repeat"]["cached_tokens"],
                                                  conversation["prompt_tokens"] - conversation["computed_tokens"]])


def test_prefix_bench_refuses_the_completions_endpoint(capsys):
    assert main(["bench", "--url", "http://127.0.0.1:1", "--prefix-cache", "--endpoint", "completions"]) == 2
    assert "replays chat conversations" in capsys.readouterr().err
