"""`verispec bench --workload`: prompts whose answers repeat them (edit, quote, json) beside random
words, built from text shipped with verispec; and `--write-draft-costs`. Speed is never asserted."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from verispec.bench.workloads import Workload, tokenized_workload_prompt, workload_prompt
from verispec.cli import main
from verispec.engine.draft_costs import TableCosts
from verispec.loading.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_helpers import live_server  # noqa: E402

ASKS = {Workload.EDIT: "reply with the whole updated file", Workload.QUOTE: "quoted exactly from the document",
        Workload.JSON: "Reply with the same JSON"}


@pytest.mark.parametrize("workload", list(Workload))
def test_each_workload_builds_the_same_prompt_from_the_same_arguments(workload):
    a = workload_prompt(workload, "t", 512, 0, 300)
    assert a == workload_prompt(workload, "t", 512, 0, 300)
    assert a != workload_prompt(workload, "t", 512, 1, 300)  # each repeat its own prompt
    assert 200 < len(a.split()) < 600
    if workload is not Workload.RANDOM:
        assert a.startswith(f"[bench t {workload.value} ctx 512 run 0]") and ASKS[workload] in a
    assert len(workload_prompt(workload, "t", 512, 0, 1200).split()) > 2 * len(a.split())


def test_the_json_workload_is_json_with_the_field_to_change():
    text = workload_prompt(Workload.JSON, "t", 256, 3, 200)
    body = text[text.index("{"):text.rindex("}\n\nReply") + 1]
    records = json.loads(body)["records"]
    target = int(text.split('"id": ')[-1].split(" ")[0])
    assert any(r["id"] == target for r in records)


@pytest.mark.parametrize("workload", [Workload.EDIT, Workload.QUOTE, Workload.JSON])
def test_tokenized_prompts_fit_the_context_with_their_instruction(tokenizer_dir, workload):
    tok = Tokenizer.from_dir(tokenizer_dir)
    ids = tokenized_workload_prompt(tok, workload, "offline", 200, 0)
    assert 100 < len(ids) <= 200
    assert ASKS[workload].split()[-1] in tok.decode(ids)  # never cut off at the end


def test_offline_bench_runs_a_workload_and_writes_a_draft_cost_table(qwen3_dir, tmp_path, capsys):
    out, table = tmp_path / "out", tmp_path / "costs.json"
    rc = main(["bench", "-m", str(qwen3_dir), "--device", "cpu", "--dtype", "float32", "--methods", "ar,suffix",
               "--contexts", "96", "--gen-tokens", "4", "--repeats", "1", "--step-iters", "2", "--workload", "edit",
               "--concurrency", "1,2", "--write-draft-costs", str(table), "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads((out / "bench.json").read_text())
    assert report["meta"]["workload"] == "edit"
    assert {r["method"] for r in report["rows"]} == {"ar", "suffix"}
    costs = TableCosts.load(table)  # what `serve --draft-costs FILE` reads
    assert {b for b, _ in costs.verify_points} == {1, 2} and {w for _, w in costs.verify_points} == {1, 2, 3}
    assert json.loads(table.read_text())["method"] == "suffix"


@pytest.mark.parametrize("workload", ["quote", "json"])
def test_offline_bench_accepts_every_workload(qwen3_dir, capsys, workload):
    rc = main(["bench", "-m", str(qwen3_dir), "--device", "cpu", "--dtype", "float32", "--methods", "suffix",
               "--contexts", "80", "--gen-tokens", "4", "--repeats", "1", "--step-iters", "2",
               "--workload", workload, "--draft-schedule", "adaptive"])
    assert rc == 0, capsys.readouterr().err


def test_http_bench_sends_the_workloads_prompts(qwen3_dir, capsys):
    from verispec.engine.engine import load_engine
    from verispec.server.app import create_app

    engine = load_engine(str(qwen3_dir), dtype="float32", device="cpu")
    with live_server(create_app(engine, "tiny-bench")) as server:
        rc = main(["bench", "--url", server.url, "--workload", "json", "--contexts", "60", "--gen-tokens", "4",
                   "--repeats", "1", "--concurrency", "2"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err


@pytest.mark.parametrize("argv, message", [
    (["--shape", "tiny", "--workload", "poem"], "--workload: 'poem' is not a workload (available: random, edit, "
                                                 "quote, json)"),
    (["--shape", "tiny", "--workload", "edit"], "--workload edit asks a model to copy text: it needs a checkpoint"),
    (["--shape", "tiny", "--write-draft-costs", "x.json"], "--write-draft-costs times a proposer's passes offline"),
    (["--shape", "tiny", "--draft-schedule", "1:x"], "--draft-schedule '1:x': each entry is BATCH:DRAFTS"),
])
def test_bad_workload_flags_are_one_line(argv, message, capsys):
    rc = main(["bench", *argv, "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and message in err, err
