"""`verispec bench`: offline on the tiny shape (CPU), over HTTP against a live server, and its errors.

Speed is never asserted (DESIGN.md): only that the numbers exist, are positive and are computed
from the right quantities.
"""
from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch

from verispec.bench.build import random_target
from verispec.bench.prompts import text_prompt, token_prompt
from verispec.bench.report import BenchReport, markdown
from verispec.bench.roofline import mean_decode_context, token_bytes
from verispec.bench.shapes import SHAPES
from verispec.cli import main

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_helpers import live_server  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tiny_bytes(context: int, item: int) -> int:
    """Bytes per decode token of the tiny shape, by hand: hidden 64, 2 layers, 4 q / 2 kv heads x 16,
    MLP 128, vocab 512, untied, Qwen3 q/k norms."""
    h, layers, q_heads, kv_heads, d, inter, vocab = 64, 2, 4, 2, 16, 128, 512
    attention = h * q_heads * d + 2 * h * kv_heads * d + q_heads * d * h + 2 * d  # q, k, v, o, q/k norms
    per_layer = attention + 3 * h * inter + 2 * h  # + gated MLP + two RMSNorms
    weights = layers * per_layer + h + vocab * h + h  # + final norm + lm_head + one embedding row
    kv = layers * 2 * kv_heads * d * context  # K and V rows of every layer
    return (weights + kv) * item


def test_bytes_per_token_matches_hand_computation():
    for dtype, item in ((torch.float32, 4), (torch.bfloat16, 2)):
        model = random_target("tiny", SHAPES["tiny"].config, torch.device("cpu"), dtype).model
        for context in (0, 100, 4000):
            assert token_bytes(model, context).total == _tiny_bytes(context, item)


def test_fp8_cache_bytes_are_a_byte_a_value_and_an_exponent_a_row():
    model = random_target("tiny", SHAPES["tiny"].config, torch.device("cpu"), torch.bfloat16).model
    layers, kv_heads, d, context = 2, 2, 16, 100
    fp8 = token_bytes(model, context, "fp8")
    assert fp8.weights == token_bytes(model, context).weights
    assert fp8.kv == layers * 2 * kv_heads * (d + 1) * context  # a one-byte exponent scales each K and V row


def test_offline_tiny_shape_writes_json_markdown_png(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", "--shape", "tiny", "--device", "cpu", "--methods", "ar,eagle3", "--contexts", "16,40",
               "--gen-tokens", "8", "--repeats", "1", "--step-iters", "3", "--compare", "transformers",
               "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads((out / "bench.json").read_text())
    assert report["mode"] == "offline"
    assert report["meta"]["target"] == "tiny" and report["meta"]["bandwidth_tbs"] is None
    rows = {(r["method"], r["context"]): r for r in report["rows"]}
    assert set(rows) == {(m, c) for m in ("ar", "eagle3", "transformers") for c in (16, 40)}
    for (method, context), r in rows.items():
        for key in ("ttft_ms", "prefill_tok_s", "decode_tok_s"):
            assert r[key] > 0, (method, context, key)
        assert r["bytes_per_token"] == _tiny_bytes(mean_decode_context(context, 8), 4)
        assert r["roofline_tok_s"] is None and r["roofline_fraction"] is None  # CPU: no bandwidth
        assert r["runs"][0]["generated_tokens"] == 8
    for context in (16, 40):
        spec = rows[("eagle3", context)]
        for key in ("decode_step_ms", "verify_step_ms", "draft_round_ms", "verify_decode_ratio",
                    "draft_cost_fraction", "speedup_ceiling", "speedup_vs_ar", "speedup_vs_transformers"):
            assert spec[key] > 0, key
        assert spec["draft_block"] == 2 and spec["drafted"] > 0 and 0 <= spec["acceptance"] <= 1
        assert rows[("ar", context)]["speedup_vs_transformers"] > 0
    md = (out / "bench.md").read_text()
    assert md in captured.out  # the table goes to stdout too
    assert "| method | context | TTFT ms | prefill tok/s | decode tok/s | bytes/token |" in md
    assert "| eagle3 | 40 |" in md and "verify/decode" in md and "n/a" in md
    assert (out / "bench.png").read_bytes()[:8] == PNG_MAGIC


def test_offline_mtp_on_a_hybrid_shape(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", "--shape", "tiny-hybrid", "--device", "cpu", "--methods", "ar,mtp", "--contexts", "20",
               "--gen-tokens", "8", "--repeats", "1", "--step-iters", "2", "--draft-block", "3", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads((out / "bench.json").read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"ar", "mtp"}
    mtp = rows["mtp"]
    assert mtp["draft_block"] == 3 and mtp["drafted"] > 0 and 0 <= mtp["acceptance"] <= 1
    for key in ("verify_step_ms", "draft_round_ms", "verify_decode_ratio", "draft_cost_fraction", "speedup_vs_ar"):
        assert mtp[key] > 0, key
    assert "random weights" in captured.out  # the note says the head is random


def test_roofline_with_given_bandwidth(capsys):
    rc = main(["bench", "--shape", "tiny", "--device", "cpu", "--contexts", "8", "--gen-tokens", "4",
               "--repeats", "1", "--bandwidth", "0.001"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    roofline = 1e9 / _tiny_bytes(mean_decode_context(8, 4), 4)
    assert f"{roofline:,.0f}" in captured.out or f"{roofline:.1f}" in captured.out
    assert "bandwidth 0.001 TB/s (--bandwidth)" in captured.out


def test_prompts_are_distinct_per_context_and_repeat():
    texts = {text_prompt("c0", c, r, 50) for c in (512, 4096) for r in range(3)}
    assert len(texts) == 6
    assert token_prompt(64, 0, 1000) != token_prompt(64, 1, 1000) == token_prompt(64, 1, 1000)


def test_markdown_drops_empty_optional_columns():
    row = {"method": "ar", "context": 512, "ttft_ms": 12.0, "prefill_tok_s": 4e4, "decode_tok_s": 50.0,
           "bytes_per_token": 15.2e9, "roofline_tok_s": 282.0, "roofline_fraction": 50 / 282}
    md = markdown(BenchReport("offline", {"gen_tokens": 128, "repeats": 3, "bandwidth_tbs": 4.29}, [row]))
    assert "| ar | 512 | 12.0 | 40,000 | 50.0 | 15.20 GB | 282.0 | 17.7% |" in md
    assert "verify/decode" not in md and "vs AR" not in md


# ---- HTTP -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served_engine(qwen3_dir):
    from verispec.engine.engine import load_engine
    from verispec.server.app import create_app

    engine = load_engine(str(qwen3_dir), dtype="float32", device="cpu")
    prompts: list[list[int]] = []
    real_submit = engine.submit

    def recording_submit(prompt_ids, params, sink, cancel=None):  # the server hands requests to submit()
        prompts.append(list(prompt_ids))
        return real_submit(prompt_ids, params, sink, cancel)

    engine.submit = recording_submit
    with live_server(create_app(engine, "tiny-bench")) as server:
        yield server, prompts


def test_http_bench_against_live_server(served_engine, tmp_path, capsys):
    server, prompts = served_engine
    prompts.clear()
    out = tmp_path / "http"
    rc = main(["bench", "--url", server.url, "--contexts", "40,80", "--gen-tokens", "6", "--repeats", "2",
               "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads((out / "bench.json").read_text())
    assert report["mode"] == "http" and report["meta"]["models"] == ["tiny-bench"]
    assert [r["context"] for r in report["rows"]] == [40, 80]
    for r in report["rows"]:
        assert r["ttft_ms"] > 0 and r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
        assert r["tokens_from_usage"] and r["completion_tokens"] == 6  # usage, ignore_eos
        assert all(q["completion_tokens"] == 6 for q in r["requests"])
        assert r["prompt_tokens"] > 0.5 * r["context"]
    # one warm-up + 2 contexts x 2 repeats, every prompt different from the first token of the message
    assert len(prompts) == 5
    assert len({tuple(p) for p in prompts}) == 5
    heads = [q["prompt_head"] for r in report["rows"] for q in r["requests"]]
    assert len(set(heads)) == len(heads) == 4
    assert "| config | context | prompt tokens | TTFT ms |" in captured.out
    assert (out / "bench.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow  # boots a subprocess / builds a model end to end: `make test-slow`
def test_http_bench_boots_the_server_and_reports_cold_start(qwen3_dir, tmp_path, capsys):
    out = tmp_path / "serve"
    rc = main(["bench", f"--serve=-m {qwen3_dir} --device cpu --dtype float32", "--contexts", "30",
               "--gen-tokens", "4", "--repeats", "1", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    (row,) = json.loads((out / "bench.json").read_text())["rows"]
    assert row["server_ready_s"] > 0 and row["first_request_ttft_ms"] > 0
    assert row["completion_tokens"] == 4
    assert "ready after launch s" in captured.out and "first request TTFT ms" in captured.out


def test_http_bench_completions_endpoint(served_engine, capsys):
    server, _ = served_engine
    rc = main(["bench", "--url", server.url, "--endpoint", "completions", "--contexts", "30", "--gen-tokens", "4",
               "--repeats", "1"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "| completions" not in captured.out and "over HTTP (completions)" in captured.out


@pytest.mark.slow  # boots a subprocess / builds a model end to end: `make test-slow`
def test_serve_boots_measures_and_stops_a_server(qwen3_dir, capsys):
    rc = main(["bench", f"--serve=-m {qwen3_dir} --dtype float32 --no-prewarm", "--contexts", "24",
               "--gen-tokens", "4", "--repeats", "1"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert f"| -m {qwen3_dir} --dtype float32 --no-prewarm | 24 |" in captured.out


# ---- errors -----------------------------------------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, message", [
    (["--shape", "nope"], "--shape 'nope' is not a known shape (available shapes: "),
    (["--shape", "tiny", "--methods", "ar,warp"], "--methods: 'warp' is not an available method (available: ar, eagle3, mtp, suffix)"),
    (["--shape", "tiny", "--methods", "mtp", "--device", "cpu"], "--methods mtp: model type 'qwen3' has no MTP head"),
    (["--shape", "tiny", "--compare", "vllm"], "--compare: 'vllm' is not supported"),
    (["--shape", "tiny", "--contexts", "4k,abc"], "--contexts: 'abc' is not a number"),
    (["--shape", "tiny", "--contexts", "4090", "--gen-tokens", "64"], "does not fit this model's 4096-token context"),
    (["--shape", "tiny", "--repeats", "0"], "--repeats must be >= 1"),
    (["--url", "http://127.0.0.1:{port}"], "cannot reach http://127.0.0.1:{port}"),
    (["--url", "http://127.0.0.1:{port}", "--methods", "eagle3"], "--methods is for offline runs"),
    (["--url", "localhost:9999"], "must start with http://"),
])
def test_errors_are_one_line_exit_2(argv, message, capsys):
    port = _closed_port()
    argv = [a.format(port=port) for a in argv]
    rc = main(["bench", *argv, "--device", "cpu"] if "--url" not in argv else ["bench", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("verispec: error: "), err
    assert message.format(port=port) in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda(capsys):
    assert main(["bench", "--shape", "tiny", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CUDA is not available" in err


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_serve_that_fails_to_start_is_one_line(capsys, tmp_path):
    rc = main(["bench", f"--serve=-m {tmp_path / 'missing'}", "--contexts", "16", "--repeats", "1",
               "--serve-timeout", "60"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "the server exited with status" in err, err


def test_argparse_needs_exactly_one_source(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--shape", "tiny", "--url", "http://127.0.0.1:1"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_offline_bench_needs_no_server_packages(tmp_path):
    """The GPU machine has no fastapi/uvicorn/pydantic (nor the openai client): offline mode must
    not import them (nor httpx)."""
    import subprocess

    blocked = ["fastapi", "uvicorn", "starlette", "pydantic", "httpx", "openai"]
    code = (f"import sys; sys.modules.update(dict.fromkeys({blocked!r})); from verispec.cli import main; "
            "raise SystemExit(main(['bench', '--shape', 'tiny', '--device', 'cpu', '--methods', 'ar,eagle3', "
            f"'--contexts', '8', '--gen-tokens', '4', '--repeats', '1', '--step-iters', '2', '--out', {str(tmp_path)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "bench.json").is_file()


def test_moe_bytes_count_only_routed_experts(tmp_path):
    """A MoE decode step reads top_k of E experts per layer, everything else in full."""
    from verispec.bench.roofline import inactive_expert_bytes, weight_bytes
    from tools.tiny import build_tiny_gemma4
    from verispec.loading.model_loader import load_model

    build_tiny_gemma4(tmp_path / "moe", moe=True)
    model = load_model(tmp_path / "moe", torch.float32, torch.device("cpu"))
    s = model.settings
    experts = sum(p.numel() * 4 for p in model.parameters() if p.dim() == 3 and p.shape[0] == s.num_experts)
    assert experts > 0
    assert inactive_expert_bytes(model) == experts * (s.num_experts - s.top_k_experts) // s.num_experts
    everything = sum(p.numel() * 4 for p in model.parameters())
    embed = model.input_embeddings().weight
    assert weight_bytes(model) == everything - inactive_expert_bytes(model)  # tied head: embedding read in full
    assert embed is model.lm_head.weight


@pytest.mark.parametrize("name, total, active", [("qwen3-30b-a3b", 30.53e9, 3.04e9),
                                                 ("qwen3.6-35b-a3b", 34.66e9, 2.946e9)])
def test_qwen_moe_shapes_read_routed_and_shared_experts(name, total, active):
    """The shapes built on the meta device: the published parameter counts (30.5B; 35B with the
    vision tower and MTP head, which the text model leaves out) and a decode step reading the top-8
    routed experts of each layer, the shared expert, attention / Gated DeltaNet, the router and
    lm_head in full, and one embedding row (3.3B / 3B active less the embedding table)."""
    from verispec.bench.roofline import inactive_expert_bytes, weight_bytes
    from verispec.bench.shapes import get_shape
    from verispec.models.registry import model_class

    shape = get_shape(name)
    with torch.device("meta"):
        model = model_class(shape.model_type)(dict(shape.config)).to(torch.bfloat16)
    moe = model.settings.moe
    params = dict(model.named_parameters())
    stacks = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    assert sum(p.numel() for p in params.values()) == pytest.approx(total, rel=1e-3)
    assert inactive_expert_bytes(model) == 2 * stacks * (moe.num_experts - moe.top_k) // moe.num_experts
    assert weight_bytes(model) / 2 == pytest.approx(active, rel=1e-3)
    if name == "qwen3.6-35b-a3b":
        assert any(".mlp.shared_expert." in n for n in params)  # read in full: not in the stacks
    # a step of N tokens reads the expected union of N uniform routings, once: more tokens, more
    # experts, never more than all of them
    e, k = moe.num_experts, moe.top_k
    for tokens in (2, 8, 64):
        read = 2 * stacks - inactive_expert_bytes(model, tokens)
        assert read == pytest.approx(2 * stacks * (1 - (1 - k / e) ** tokens), rel=1e-6)
    assert weight_bytes(model, 8) > weight_bytes(model, 2) > weight_bytes(model)
    assert weight_bytes(model, 4096) == pytest.approx(sum(2 * p.numel() for p in params.values())
                                                      - 2 * model.input_embeddings().weight.numel(), rel=1e-3)


@pytest.mark.slow  # kept out of `make test` for time; `make test-slow` (and CI) runs it
def test_offline_shape_split_over_two_ranks(tmp_path, capsys):
    """Random weights on each of two ranks (gloo); eagle3's random drafter runs on rank 0."""
    out = tmp_path / "out"
    rc = main(["bench", "--shape", "tiny", "--device", "cpu", "--methods", "ar,eagle3", "--contexts", "16",
               "--gen-tokens", "6", "--repeats", "1", "--step-iters", "2", "--tensor-parallel-size", "2",
               "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {"ar", "eagle3"}
    assert all(r["decode_tok_s"] > 0 and r["runs"][0]["generated_tokens"] == 6 for r in rows)
    assert not torch.distributed.is_initialized()  # the worker ranks stopped, the group with them


def test_the_70b_shape_is_llama_3_3():
    from verispec.models.sharding import check_shardable

    from verispec.models.registry import model_class

    config = SHAPES["llama3.3-70b"].config
    with torch.device("meta"):
        built = model_class(config["model_type"])(dict(config))
    assert sum(p.numel() for p in built.parameters()) == pytest.approx(70.55e9, rel=0.01)
    for size in (2, 4, 8):
        check_shardable(config, size)


def test_a_layer_with_a_kernel_copy_counts_the_copy_not_its_words():
    """On a CPU a 4-bit layer runs the integer-dot kernel on its own blocks: a decode step reads
    those, and the checkpoint's words are dropped once they are made."""
    from verispec.bench.roofline import weight_bytes
    from verispec.quant import dispatch
    from verispec.quant.kernels import cpu_qdot
    from verispec.quant.layers.linear import MLXAffineLinear

    if cpu_qdot.failure() is not None:
        pytest.skip(f"no integer-dot kernel: {cpu_qdot.failure()}")

    class Model(torch.nn.Module):  # weight_bytes needs a model with an (untied) input table
        def __init__(self):
            super().__init__()
            self.table, self.layer = torch.nn.Embedding(4, 64), MLXAffineLinear(64, 32, 4, 32)

        def input_embeddings(self):
            return self.table

    model = Model().half()
    model.layer.scales.data.fill_(0.5)  # the loader fills scales and offsets: uninitialised ones may be NaN,
    model.layer.biases.data.fill_(-4.0)  # which no float16 block can hold
    before, words = weight_bytes(model), model.layer.checkpoint_bytes()
    dispatch.make_copies(model, torch.float16)
    assert model.layer.qdot_blocks is not None and model.layer.released()  # the copy alone holds the weight
    assert weight_bytes(model) == before - words + model.layer.qdot_blocks.numel()
