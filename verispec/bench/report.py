"""Benchmark results as bench.json (everything), bench.md (the table) and bench.png (a chart)."""
from __future__ import annotations

import datetime
import json
import math
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import verispec


@dataclass
class BenchReport:
    mode: str  # "offline" or "http"
    meta: dict
    rows: list[dict]

    def as_json(self) -> dict:
        return {"mode": self.mode, "meta": self.meta, "rows": self.rows}


def run_metadata(opts, device: torch.device | None = None, dtype: torch.dtype | None = None) -> dict:
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "verispec": verispec.__version__,
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gen_tokens": opts.gen_tokens,
        "repeats": opts.repeats,
        "contexts": list(opts.contexts),
    }
    if device is not None:
        meta["device"] = _device_name(device)
        meta["dtype"] = str(dtype).removeprefix("torch.")
        meta["methods"] = [m.value for m in opts.methods]
        meta["draft_block"] = opts.draft_block
        meta["prefill_step_size"] = opts.prefill_step_size
        meta["compare"] = [p.value for p in opts.compare]
        if opts.compare:
            import transformers

            meta["transformers"] = transformers.__version__
    return meta


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(verispec.__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


# ---- Markdown ---------------------------------------------------------------------------------

def _num(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float) and abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _ratio(value) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _bytes(value) -> str:
    if value is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value} B"


# (key, header, formatter, always shown); optional columns appear when any row has a value
OFFLINE_COLUMNS = [
    ("method", "method", str, True),
    ("context", "context", str, True),
    ("concurrency", "sequences", str, False),
    ("aggregate_tok_s", "aggregate tok/s", _num, False),
    ("per_request_tok_s", "per-request tok/s", _num, False),
    ("ttft_p99_ms", "TTFT p99 ms", _num, False),
    ("num_drafts", "drafts/round", lambda v: "" if v is None else f"{v:.2f}", False),
    ("speedup_vs_batch1", "vs batch 1", lambda v: "" if v is None else f"{v:.2f}x", False),
    ("ttft_ms", "TTFT ms", _num, True),
    ("prefill_tok_s", "prefill tok/s", _num, True),
    ("decode_tok_s", "decode tok/s", _num, True),
    ("bytes_per_token", "bytes/token", _bytes, True),
    ("roofline_tok_s", "roofline tok/s", _num, True),
    ("roofline_fraction", "of roofline", _pct, True),
    ("verify_decode_ratio", "verify/decode", lambda v: "" if v is None else f"{v:.2f}", False),
    ("draft_cost_fraction", "draft/token (steps)", lambda v: "" if v is None else f"{v:.3f}", False),
    ("acceptance", "acceptance", lambda v: "" if v is None else f"{100 * v:.1f}%", False),
    ("tokens_per_round", "tok/round", lambda v: "" if v is None else f"{v:.2f}", False),
    ("speedup_ceiling", "ceiling (all accepted)", lambda v: "" if v is None else f"{v:.2f}x", False),
    ("speedup_vs_ar", "vs AR", lambda v: "" if v is None else f"{v:.2f}x", False),
    ("vs_unconstrained", "vs no grammar", lambda v: "" if v is None else f"{v:.3f}x", False),
    ("speedup_vs_transformers", "vs transformers", lambda v: "" if v is None else f"{v:.2f}x", False),
    ("peak_memory_gib", "peak GiB", lambda v: "" if v is None else f"{v:.1f}", False),
]

HTTP_COLUMNS = [
    ("config", "config", str, True),
    ("context", "context", str, True),
    ("concurrency", "clients", str, False),
    ("aggregate_tok_s", "aggregate tok/s", _num, False),
    ("ttft_p99_ms", "TTFT p99 ms", _num, False),
    ("speedup_vs_one_client", "vs 1 client", lambda v: "" if v is None else f"{v:.2f}x", False),
    ("prompt_tokens", "prompt tokens", lambda v: "n/a" if v is None else str(round(v)), True),
    ("ttft_ms", "TTFT ms", _num, True),
    ("prefill_tok_s", "prefill tok/s", _num, True),
    ("decode_tok_s", "decode tok/s", _num, True),
    ("completion_tokens", "completion tokens", lambda v: "n/a" if v is None else str(round(v)), True),
    ("acceptance", "acceptance", lambda v: "" if v is None else f"{100 * v:.1f}%", False),
    ("speedup_vs_first", "vs first config", lambda v: "" if v is None else f"{v:.2f}x", False),
    ("server_ready_s", "ready after launch s", lambda v: "" if v is None else f"{v:.1f}", False),
    ("first_request_ttft_ms", "first request TTFT ms", lambda v: "" if v is None else f"{v:.1f}", False),
    ("peak_memory_gib", "peak GiB", lambda v: "" if v is None else f"{v:.1f}", False),
]


def markdown(report: BenchReport) -> str:
    if report.mode == "prefix":
        from verispec.bench.prefix import prefix_markdown

        return prefix_markdown(report)
    meta = report.meta
    lines = []
    if report.mode == "offline":
        lines.append(f"## verispec bench: {meta.get('target')} ({meta.get('weights')})")
        bw = meta.get("bandwidth_tbs")
        lines.append(f"device {meta.get('device')}, {meta.get('dtype')}, torch {meta.get('torch')}; "
                     f"{meta['gen_tokens']} generated tokens, median of {meta['repeats']} runs after a warm-up; "
                     f"bandwidth {'n/a' if bw is None else f'{bw:.3g} TB/s'} ({meta.get('bandwidth_source')})")
        graphs = meta.get("cuda_graphs") or {}
        if graphs and str(meta.get("device", "")).startswith("cuda"):
            lines.append("CUDA graphs: " + ", ".join(f"{m} {'on' if on else 'off'}" for m, on in graphs.items()))
        if meta.get("drafter"):
            lines.append(f"drafter: {meta['drafter']}; {meta.get('draft_block')} drafts per round")
        columns = OFFLINE_COLUMNS
    else:
        lines.append(f"## verispec bench over HTTP ({meta.get('endpoint')})")
        lines.append(f"{meta['gen_tokens']} max tokens, temperature 0, median of {meta['repeats']} requests "
                     f"after one warm-up request; a distinct prompt per request")
        columns = HTTP_COLUMNS
    shown = [c for c in columns if c[3] or any(r.get(c[0]) is not None for r in report.rows)]
    lines.append("")
    lines.append("| " + " | ".join(c[1] for c in shown) + " |")
    lines.append("|" + "|".join("---" for _ in shown) + "|")
    for r in report.rows:
        lines.append("| " + " | ".join(c[2](r.get(c[0])) for c in shown) + " |")
    return "\n".join(lines) + "\n"


# ---- chart ------------------------------------------------------------------------------------

def write_png(report: BenchReport, path: Path) -> bool:
    """Decode tok/s and TTFT against context, one line per method. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    key = "method" if report.mode == "offline" else "config"
    series: dict[str, list[dict]] = {}
    for r in report.rows:
        series.setdefault(str(r[key]), []).append(r)
    fig, (ax_decode, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, rows in series.items():
        rows = sorted(rows, key=lambda r: r["context"])
        xs = [r["context"] for r in rows]
        ax_decode.plot(xs, [r.get("decode_tok_s") or 0 for r in rows], marker="o", label=name)
        ax_ttft.plot(xs, [r.get("ttft_ms") or 0 for r in rows], marker="o", label=name)
    roof = sorted({(r["context"], r["roofline_tok_s"]) for r in report.rows if r.get("roofline_tok_s")})
    if roof:
        ax_decode.plot([c for c, _ in roof], [v for _, v in roof], linestyle="--", color="gray",
                       label="bandwidth roofline")
    contexts = sorted({r["context"] for r in report.rows})
    for ax, title, ylabel in ((ax_decode, "decode speed", "tokens/s"), (ax_ttft, "time to first token", "ms")):
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if len(contexts) > 1 and contexts[-1] / max(contexts[0], 1) >= 8:
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_decode.set_ylim(bottom=0)
    name = report.meta.get("target") or report.meta.get("endpoint") or ""
    fig.suptitle(f"verispec bench {name} — {report.meta.get('device', '')}".strip(" —"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(report: BenchReport, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    json_path = out_dir / "bench.json"
    json_path.write_text(json.dumps(report.as_json(), indent=1, default=str) + "\n")
    written.append(json_path)
    md_path = out_dir / "bench.md"
    md_path.write_text(markdown(report))
    written.append(md_path)
    png_path = out_dir / "bench.png"
    if report.mode == "prefix":  # tables only
        pass
    elif write_png(report, png_path):
        written.append(png_path)
    else:
        sys.stderr.write("verispec bench: bench.png not written: matplotlib is not installed "
                         "(pip install 'verispec[bench]')\n")
    return written
