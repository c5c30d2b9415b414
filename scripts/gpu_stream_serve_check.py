"""On the lent GPU: a 4-bit model whose MLPs take the streaming kernel (kernels/stream_mlp.py),
served over HTTP with the engine in its own process (the CUDA default), against the same model
offline. A tiny random Qwen3 (hidden 512, MLP 1,024, 4 layers), MLX 4-bit by `verispec quantize`:
- one request at a time over HTTP (/v1/completions, prompt as token ids, temperature 0) must give
  the offline engine's greedy tokens;
- 8 concurrent requests must all complete (200, the requested token count each);
- the server's log must say the MLPs took the streaming kernel (VERISPEC_DEBUG=1).

  python3 scripts/gpu_stream_serve_check.py [--tokens 48]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verispec.bench.http import served  # noqa: E402
from verispec.bench.options import BenchOptions  # noqa: E402
from verispec.cli import main as main_cli  # noqa: E402
from tools.tiny import build_tiny_model, build_tokenizer  # noqa: E402
from verispec.engine.engine import load_engine  # noqa: E402
from verispec.engine.params import SamplingParams  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):", "x = [",
           "for i in range(10):\n    print(i)\n", "# sorts a list\ndef sort(xs):", "while True:", "with open("]


def complete(url: str, ids: list[int], tokens: int) -> tuple[int, dict]:
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        reply = json.loads(response.read())
        return response.status, reply


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    build_tokenizer(root / "tok")
    build_tiny_model(root / "qwen3", "qwen3", seed=0, tokenizer_dir=root / "tok", num_hidden_layers=4,
                     hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2)
    model = root / "qwen3-4bit"
    if main_cli(["quantize", "-m", str(root / "qwen3"), "--format", "mlx-4bit", "--out", str(model)]) != 0:
        raise SystemExit("quantize failed")
    engine = load_engine(str(model), device="cuda", kv_cache_gb=2)
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    offline = [engine.tokenizer.decode(engine.generate_all(ids, greedy).token_ids) for ids in prompts]
    streamed = sum(m.stream is not None for m in engine.model.modules() if hasattr(m, "use_stream"))
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    os.environ["VERISPEC_DEBUG"] = "1"
    log = root / "serve.log"
    result = {"offline_mlps_streamed": streamed}
    serve_args = f"-m {model} --served-model-name m --no-prefix-cache --kv-cache-gb 2"
    with served(serve_args, BenchOptions(), log_path=log) as (url, cold_start):
        result["cold_start_s"] = round(cold_start, 1)
        one_at_a_time = [complete(url, ids, args.tokens)[1] for ids in prompts[:3]]
        texts = [reply["choices"][0]["text"] for reply in one_at_a_time]
        result["http_equals_offline"] = [text == want for text, want in zip(texts, offline)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda ids: complete(url, ids, args.tokens), prompts))
        result["concurrent_ok"] = sum(status == 200 and reply["usage"]["completion_tokens"] == args.tokens
                                      for status, reply in replies)
    served_log = log.read_text()
    result["server_log_streaming"] = [line.strip() for line in served_log.splitlines() if "streaming kernel" in line]
    print(json.dumps(result, indent=1))
    ok = (result["offline_mlps_streamed"] == 4 and all(result["http_equals_offline"])
          and result["concurrent_ok"] == len(prompts) and result["server_log_streaming"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
