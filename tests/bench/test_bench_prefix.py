"""`verispec bench --prefix-cache`: the three measurements come out, and what they count is what the
engine did (a repeated prompt reuses all its whole blocks but one token's; a conversation computes
fewer prompt tokens than it sends)."""
from __future__ import annotations

import json

from verispec.cli import main


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


def test_prefix_bench_refuses_http(capsys):
    assert main(["bench", "--url", "http://127.0.0.1:1", "--prefix-cache"]) == 2
    assert "--prefix-cache is measured offline" in capsys.readouterr().err
