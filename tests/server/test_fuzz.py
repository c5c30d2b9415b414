"""A bounded schemathesis run against a live server on the tiny model: the server never answers a
5xx, every response agrees with the OpenAPI document (status codes, content types, bodies, the
Allow header of a 405), and schema-invalid requests are refused with a 4xx."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server_helpers import SERVED_NAME, live_server
from verispec.engine.engine import load_engine
from verispec.server.app import create_app

pytest.importorskip("schemathesis", reason="the fuzz test needs schemathesis: pip install -e '.[test]'")

CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_headers_conformance", "response_schema_conformance", "negative_data_rejection",
          "unsupported_method", "allow_header_conformance")
MAX_EXAMPLES = 40  # per operation
MAX_TIME_S = 60


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    # A short context and default max_tokens keep generated requests quick; n up to 16 still runs.
    engine = load_engine(str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=96,
                         default_max_tokens=8)
    with live_server(create_app(engine, SERVED_NAME)) as srv:
        yield srv
    engine.shutdown()


@pytest.mark.slow  # 30-70 s on the 2-core CI machine: `make test-slow` runs it
def test_schemathesis_finds_no_server_error_or_schema_violation(fuzz_server, tmp_path):
    st = Path(sys.executable).with_name("st")
    # --workers 1: with 2, hypothesis (describing a strategy via ast.parse from two threads) failed with
    # CPython 3.11's "AST constructor recursion depth mismatch", an error of the tool, not the server.
    command = [str(st), "run", fuzz_server.url + "/openapi.json", "--checks", ",".join(CHECKS),
               "--max-examples", str(MAX_EXAMPLES), "--max-time", str(MAX_TIME_S), "--workers", "1",
               "--request-timeout", "30", "--seed", "18",
               # health checks judge the generator (e.g. path parameters filtered), not the server
               "--suppress-health-check", "all", "--generation-database", "none",
               "--no-color", "--report", "junit", "--report-dir", str(tmp_path)]
    # cwd: schemathesis writes its state beside where it runs
    run = subprocess.run(command, capture_output=True, text=True, timeout=MAX_TIME_S + 120, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200


# Pieces that hostile text is made of: control-token spellings, emoji (4 UTF-8 bytes), combining
# marks (folded by normalizers), whitespace runs (where prompts are cut to be counted), JSON-ish text.
HOSTILE_PIECES = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "system\n", "\U0001F600",
                  "e\u0301", "\u0000", " " * 64, "\n\n", "{\"a\": [", "\ue000", "x" * 300, "word "]


def hostile_text(max_pieces: int):
    from hypothesis import strategies as st

    return st.lists(st.sampled_from(HOSTILE_PIECES) | st.text(max_size=8), max_size=max_pieces).map("".join)


def test_hostile_fields_never_break_the_server(fuzz_server):
    """Random mixes of hostile text in messages, prompts and stops, with random logit_bias (NaN and
    infinities included): every answer is a 200 or an OpenAI-style 4xx, and /health stays 200."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    bias_value = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([-100, 100, "1", None])
    bias_key = st.integers(-5, 2**40).map(str) | st.text(max_size=4)
    fields = st.fixed_dictionaries({}, optional={
        "stop": st.lists(hostile_text(40), max_size=34),
        "logit_bias": st.dictionaries(bias_key, bias_value, max_size=5),
        "n": st.integers(1, 3), "temperature": st.sampled_from([0, 1.0])})
    chat = st.builds(lambda content, extra: ("/v1/chat/completions",
                                             {"messages": [{"role": "user", "content": content}], **extra}),
                     hostile_text(200), fields)
    completion = st.builds(lambda prompt, extra: ("/v1/completions", {"prompt": prompt or "x", **extra}),
                           hostile_text(200), fields)

    statuses: list[int] = []
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as http:
        @settings(max_examples=60, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(st.one_of(chat, completion))
        def check(request):
            path, body = request
            body = {"model": SERVED_NAME, "max_tokens": 4, **body}
            response = http.post(path, content=json.dumps(body, allow_nan=True),
                                 headers={"content-type": "application/json"})
            assert response.status_code in (200, 400), response.text[:2000]
            statuses.append(response.status_code)
            if response.status_code == 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            assert http.get("/health").status_code == 200

        check()
    assert {200, 400} <= set(statuses)  # the mixes reach generation, not only the checks
