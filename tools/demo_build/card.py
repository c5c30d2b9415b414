"""The demo model's card (README.md), written from the build record (`tools/demo_build/build.py`)."""
from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tools.demo_build.build import DemoOptions


def row_device_type(row: dict) -> str:
    """A measurement row's device type: "cuda" from "cuda", "cuda:0" or "cuda (H200, bf16)"."""
    return str(row.get("device", "")).split(" ")[0].split(":")[0]


def _fmt(value, spec: str = "") -> str:
    return "n/a" if value is None else format(value, spec)


def model_card(record: dict, options: DemoOptions) -> str:
    p = record.get("pretrain", {})
    c = record.get("corpus", {})
    size = p.get("size") or asdict(options.size)
    select = record.get("select", {})
    lines = [
        "# verispec demo model",
        "",
        "A small Qwen3.5-architecture model (`qwen3_5_text`: Gated DeltaNet layers with a gated full-attention",
        "layer every fourth) trained from scratch on the Python standard library's source, with a",
        "multi-token-prediction head (`mtp.safetensors`) and an EAGLE3 drafter (`eagle3/`) trained by",
        "`verispec train-drafter`. Built by `scripts/train_demo_model.py` (`make demo-model`); a genuine",
        "Hugging Face checkpoint (transformers loads it). It writes plausible-looking Python, not correct",
        "programs: it is a demonstration of the server and of speculative decoding, not a useful assistant.",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {_fmt(p.get('parameters'), ',')} (tied embedding; bfloat16) |",
        f"| shape | hidden {size['hidden_size']}, {size['num_layers']} layers, "
        f"intermediate {size['intermediate_size']}, {size['num_heads']} heads ({size['num_kv_heads']} kv) x {size['head_dim']}, GDN {size['linear_key_heads']}/"
        f"{size['linear_value_heads']} heads x {size['linear_head_dim']} |",
        f"| vocabulary | {record.get('tokenizer', {}).get('vocab_size', 'n/a')} byte-level BPE tokens |",
        f"| training data | Python {c.get('python', '?')} stdlib"
        f"{' + ' + ', '.join(c['extra_sources']) if c.get('extra_sources') else ''}: "
        f"{c.get('train', {}).get('files', '?')} files + "
        f"{c.get('train', {}).get('chat_examples', '?')} chat examples, "
        f"{_fmt(record.get('tokenizer', {}).get('train_tokens'), ',')} tokens |",
        f"| pretraining | {p.get('steps', '?')} steps x {p.get('batch_size', '?')} x {p.get('seq_len', '?')} tokens "
        f"({p.get('epochs', '?')} epochs) in {p.get('seconds', '?')} s on {p.get('device', '?')} |",
        f"| held-out perplexity | {p.get('heldout_perplexity_code', 'n/a')} on "
        f"{c.get('heldout', {}).get('files', '?')} held-out stdlib files; {p.get('heldout_perplexity_chat', 'n/a')} on held-out chat examples |",
        "",
        "## Speculative decoding",
        "",
    ]
    by_device = select.get("speculation_by_device") or {}
    if by_device:
        for device_type, spec in by_device.items():
            lines.append(f"- default on {device_type}: `{json.dumps(spec)}` — "
                         f"{(select.get('why_by_device') or {}).get(device_type, '')}.")
    else:
        lines.append(f"Default: `{json.dumps(select.get('speculation'))}` — {select.get('why', 'not measured')}.")
    lines += ["",
              "| device | configuration | decode tok/s | vs plain | acceptance | tokens per target pass | "
              "identical to plain greedy |",
              "|---|---|---|---|---|---|---|"]
    rows = select.get("measurements", [])
    plain = {row_device_type(r): r.get("decode_tok_per_s") for r in rows if r["config"] == "ar"}
    for row in rows:
        base, speed = plain.get(row_device_type(row)), row.get("decode_tok_per_s")
        ratio = f"{speed / base:.2f}x" if isinstance(speed, (int, float)) and isinstance(base, (int, float)) else "n/a"
        lines.append(f"| {row.get('device', '?')} | {row['config']} | {speed} | {ratio} | {_fmt(row['acceptance'])} | "
                     f"{_fmt(row['tokens_per_round'])} | {row['identical_to_plain_greedy']} |")
    for method in ("mtp", "eagle3"):
        m = record.get(method)
        if m and m.get("after"):
            before = m.get("before") or {}
            lines.append("")
            lines.append(f"{method}: trained {m['steps']} steps in {m['seconds']} s; acceptance on held-out text "
                         f"{_fmt(before.get('acceptance'))} (untrained) -> {m['after']['acceptance']} at "
                         f"{m['eval_drafts']} drafts per round" +
                         (f"; draft vocabulary {m['draft_vocab_size']} ids covering "
                          f"{100 * m['draft_vocab_coverage']:.1f}% of the target's predictions"
                          if m.get("draft_vocab_size") else ""))
    lines += ["", "## Samples", ""]
    for s in record.get("samples", []):
        how = "greedy" if not s["temperature"] else f"temperature {s['temperature']}, top_p 0.95, seed 0"
        where = "raw completion" if s["kind"] == "raw" else "chat"
        lines.append(f"**{where}**, {how} ({s['method']}, acceptance {_fmt(s['acceptance'])}): `{s['prompt']!r}`")
        lines.append("")
        lines.append("```")
        lines.append((s["prompt"] if s["kind"] == "raw" else "") + s["text"])
        lines.append("```")
        lines.append("")
    lines += ["## Reproduce", "", "```bash", "python scripts/train_demo_model.py   # ~10 minutes on one H200",
              "```", ""]
    return "\n".join(lines)
