"""Build the embedded demo model from scratch: corpus, tokenizer, pretraining, MTP head, EAGLE3
drafter, choice of the default speculation, model card. `scripts/train_demo_model.py` is the
command line; `make demo-model` runs it.

- Corpus: the Python standard library's own source (on every machine, no download): every .py
  file under `sysconfig.get_paths()["stdlib"]` in sorted order, minus site-packages, data tables
  (`encodings/`, `pydoc_data/`), Python 2 test data and files over 400 KB. Files whose
  crc32(path) % 50 == 0 are held out. Beside the raw files, chat examples made from the
  functions in them (user: a signature or a request built from the docstring; assistant: the
  function; a quarter with a `<think>` block holding the docstring), in the ChatML template.
- Tokenizer: byte-level BPE (`tokenizers`), `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` special,
  `<think>`/`</think>` added (kept in decoded text for the reasoning parser), ChatML template.
- Model: transformers' Qwen3_5ForCausalLM (model_type qwen3_5_text: Gated DeltaNet layers with a
  gated full-attention layer every fourth), tied embeddings, trained with the standard next-token
  loss (AdamW, bf16 autocast on CUDA, cosine schedule, clipping) and saved with
  `save_pretrained` in bfloat16: a genuine Hugging Face checkpoint.
- Drafters: `verispec.train` (what `verispec train-drafter` runs) writes `mtp.safetensors` and
  `eagle3/`; the `select` stage measures plain, MTP and EAGLE3 decoding on held-out prompts with
  the engine and records the fastest speculative configuration in `demo.json`, which
  `verispec serve` / `generate` use when no `-m` is given.

Every stage skips when its output exists (`--force STAGE` redoes it) and pretraining resumes
from its checkpoint, so an interrupted run continues where it stopped.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tools.demo_build.card import model_card, row_device_type
from tools.demo_build.corpus import build_corpus, load_corpus, say, training_documents
from tools.demo_build.pretrain import (encode_stream, gdn_kernel_note, model_config, perplexity, pretrain,
                                    train_tokenizer)

STAGES = ("corpus", "tokenizer", "pretrain", "mtp", "eagle3", "select", "card")
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "mtp.safetensors",
               "demo.json", "README.md")
SHIP_LIMIT_BYTES = 60_000_000
DEMO_NAME = "verispec-demo"
# select: plain decoding first (the reference), then the likeliest winners, so a cut-short run has them
SELECT_ORDER = ("ar", "mtp-2", "eagle3-3", "mtp-1", "eagle3-2", "mtp-3", "eagle3-4", "eagle3-1")


@dataclass(frozen=True)
class DemoSize:
    """The model's shape and its pretraining batch."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_key_heads: int
    linear_value_heads: int
    linear_head_dim: int
    max_position_embeddings: int
    seq_len: int
    batch_size: int
    lr: float
    draft_vocab_size: int


PRESETS = {
    # ~20.8M parameters (3.1M of them the tied embedding): 42 MB in bfloat16, ~52 MB with its MTP
    # head and EAGLE3 drafter. 10 layers: Gated DeltaNet x3 + gated attention, twice, + 2 GDN.
    "demo": DemoSize(vocab_size=8192, hidden_size=384, num_layers=10, intermediate_size=1024, num_heads=6,
                     num_kv_heads=2, head_dim=64, linear_key_heads=3, linear_value_heads=6, linear_head_dim=64,
                     max_position_embeddings=4096, seq_len=1024, batch_size=64, lr=2e-3, draft_vocab_size=2048),
    # CPU tests: seconds, not quality.
    "tiny": DemoSize(vocab_size=512, hidden_size=64, num_layers=4, intermediate_size=128, num_heads=4,
                     num_kv_heads=2, head_dim=16, linear_key_heads=2, linear_value_heads=4, linear_head_dim=16,
                     max_position_embeddings=1024, seq_len=128, batch_size=16, lr=3e-3, draft_vocab_size=256),
}


@dataclass
class DemoOptions:
    out: str = "verispec/demo/model"  # where the finished model is copied (the packaged location)
    work: str = "build/demo-work"  # corpus, token streams, checkpoints, drafter runs
    preset: str = "demo"
    device: str | None = None
    seed: int = 0
    stages: tuple[str, ...] = STAGES
    force: tuple[str, ...] = ()
    pretrain_steps: int = 100_000  # with pretrain_seconds, whichever ends first
    pretrain_seconds: float | None = 270.0
    drafter_steps: int = 100_000
    drafter_seconds: float | None = 75.0
    drafter_batch: int = 32
    drafter_seq_len: int = 512
    drafter_gen_sequences: int = 1024  # continuations the target writes for its drafters' training
    vocab_sample_tokens: int = 2_000_000  # target predictions counted for the EAGLE3 draft vocabulary
    max_files: int | None = None  # corpus: at most this many files (evenly spread), None: all
    extra_sources: tuple[str, ...] = ()  # corpus: more directories of .py files beside the stdlib
    max_chars: int | None = None  # corpus: stop adding files past this many characters
    eval_prompts: int = 8
    eval_tokens: int = 128
    select_seconds: float | None = 150.0  # select: measure no more configurations after this long
    compile: bool = False  # torch.compile the model for pretraining
    size_overrides: dict = field(default_factory=dict)
    progress: bool | None = None

    @property
    def size(self) -> DemoSize:
        return replace(PRESETS[self.preset], **self.size_overrides)


def tiny_options(**overrides) -> DemoOptions:
    """The CPU test mode: a tiny model on ~40 files, seconds per stage."""
    base = dict(preset="tiny", pretrain_steps=100, pretrain_seconds=None, drafter_steps=60, drafter_seconds=None,
                drafter_batch=8, drafter_seq_len=64, drafter_gen_sequences=32, vocab_sample_tokens=50_000,
                max_files=40, max_chars=300_000, eval_prompts=2, eval_tokens=24, device="cpu")
    base.update(overrides)
    return DemoOptions(**base)


# ---- stages ----------------------------------------------------------------------------------
class DemoBuild:
    def __init__(self, options: DemoOptions):
        import torch

        from verispec.loading.device import parse_device

        if options.preset not in PRESETS:
            raise ValueError(f"--preset {options.preset!r} is not one of {', '.join(PRESETS)}")
        bad = [s for s in (*options.stages, *options.force) if s not in STAGES]
        if bad:
            raise ValueError(f"unknown stage(s) {', '.join(bad)} (stages: {', '.join(STAGES)})")
        self.options = options
        self.size = options.size
        self.work = Path(options.work)
        self.model_dir = self.work / "model"
        self.device = parse_device(options.device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.record_path = self.work / "build.json"
        self.record = json.loads(self.record_path.read_text()) if self.record_path.is_file() else {}

    def save_record(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.record_path.write_text(json.dumps(self.record, indent=2))

    def wanted(self, stage: str, done: bool) -> bool:
        if stage not in self.options.stages:
            return False
        if done and stage not in self.options.force:
            say(f"{stage}: done already (--force {stage} redoes it)")
            return False
        return True

    def run(self) -> dict:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars: noise in logs
        t0 = time.perf_counter()
        o = self.options
        if self.wanted("corpus", (self.work / "corpus" / "stats.json").is_file()):
            self.record["corpus"] = build_corpus(o, self.work)
            self.save_record()
        if self.wanted("tokenizer", (self.model_dir / "tokenizer.json").is_file()):
            self.stage_tokenizer()
        if self.wanted("pretrain", (self.model_dir / "model.safetensors").is_file()):
            self.stage_pretrain()
        if self.wanted("mtp", (self.model_dir / "mtp.safetensors").is_file()):
            self.stage_drafter("mtp")
        if self.wanted("eagle3", (self.model_dir / "eagle3" / "config.json").is_file()):
            self.stage_drafter("eagle3")
        if self.wanted("select", self.select_done()):
            self.stage_select()
        if "card" in o.stages:
            self.stage_card()
        say(f"done in {time.perf_counter() - t0:.0f}s")
        return self.record

    def select_done(self) -> bool:
        path = self.model_dir / "demo.json"
        return path.is_file() and not json.loads(path.read_text()).get("unmeasured")

    def stage_tokenizer(self) -> None:
        import torch

        t0 = time.perf_counter()
        docs = training_documents(self.work, self.options.seed, self.options)
        tok = train_tokenizer(docs, self.size.vocab_size, self.model_dir)
        sep = tok.convert_tokens_to_ids("<|endoftext|>")
        tokens = self.work / "tokens"
        tokens.mkdir(parents=True, exist_ok=True)
        torch.save(encode_stream(tok, docs, sep), tokens / "train.pt")
        held = load_corpus(self.work, "heldout", self.options)
        torch.save(encode_stream(tok, held["code"], sep), tokens / "heldout_code.pt")
        torch.save(encode_stream(tok, held["chat"], sep), tokens / "heldout_chat.pt")
        n = len(torch.load(tokens / "train.pt"))
        chars = sum(map(len, docs))
        self.record["tokenizer"] = {"vocab_size": len(tok), "train_tokens": n, "chars_per_token": round(chars / n, 2),
                                    "seconds": round(time.perf_counter() - t0, 1)}
        self.save_record()
        say(f"tokenizer: {len(tok)} tokens; training stream {n:,} tokens ({chars / n:.2f} characters per token), "
            f"{time.perf_counter() - t0:.0f}s")

    def stage_pretrain(self) -> None:
        import torch
        from transformers import AutoTokenizer, GenerationConfig, Qwen3_5ForCausalLM

        o, size = self.options, self.size
        tok = AutoTokenizer.from_pretrained(str(self.model_dir))
        config = model_config(size, tok)
        torch.manual_seed(o.seed)
        model = Qwen3_5ForCausalLM(config)
        n_params = sum(p.numel() for p in model.parameters())
        stream = torch.load(self.work / "tokens" / "train.pt")
        say(f"pretraining a {n_params / 1e6:.1f}M-parameter qwen3_5_text model on {len(stream):,} tokens "
            f"(batch {size.batch_size} x {size.seq_len}, {o.device or self.device}; Gated DeltaNet: "
            f"{gdn_kernel_note(self.device)})")
        heldout = torch.load(self.work / "tokens" / "heldout_code.pt")
        result = pretrain(model, stream, size.seq_len, size.batch_size, size.lr, o.pretrain_steps,
                          o.pretrain_seconds, self.device, self.work / "pretrain" / "state.pt", seed=o.seed,
                          progress=o.progress, compile=o.compile, heldout=heldout,
                          eval_every_s=30.0 if o.preset == "demo" else 5.0)
        model.to(torch.bfloat16)
        model.save_pretrained(str(self.model_dir), safe_serialization=True)
        GenerationConfig(eos_token_id=[config.eos_token_id, config.pad_token_id],
                         pad_token_id=config.pad_token_id).save_pretrained(str(self.model_dir))
        del model
        ppl_code = perplexity(self.model_dir, torch.load(self.work / "tokens" / "heldout_code.pt"), size.seq_len,
                              self.device)
        ppl_chat = perplexity(self.model_dir, torch.load(self.work / "tokens" / "heldout_chat.pt"), size.seq_len,
                              self.device)
        self.record["pretrain"] = {
            "parameters": n_params, "steps": result.steps, "kept_step": result.kept_step,
            "seconds": round(result.seconds, 1),
            "tokens": result.tokens, "tokens_per_second": round(result.tokens / max(result.seconds, 1e-9)),
            "epochs": round(result.tokens / len(stream), 2), "final_train_loss": round(result.final_loss, 4),
            "heldout_perplexity_code": round(ppl_code, 3), "heldout_perplexity_chat": round(ppl_chat, 3),
            "batch_size": size.batch_size, "seq_len": size.seq_len, "lr": size.lr, "device": str(self.device),
            "size": asdict(size),
        }
        self.save_record()
        rate = result.tokens / max(result.seconds, 1e-9)
        say(f"pretrained {result.steps} steps in {result.seconds:.0f}s ({rate:,.0f} tok/s, {result.tokens / len(stream):.1f} epochs); held-out perplexity: code {ppl_code:.2f}, "
            f"chat {ppl_chat:.2f}")

    def stage_drafter(self, method: str) -> None:
        from verispec.train import DrafterTrainOptions, Method, train_drafter

        o, size = self.options, self.size
        run_dir = self.work / method
        opts = DrafterTrainOptions(
            method=Method(method), model=str(self.model_dir), out=str(run_dir), steps=o.drafter_steps,
            max_seconds=o.drafter_seconds, batch_size=o.drafter_batch, seq_len=o.drafter_seq_len,
            lr=1e-3 if o.preset == "demo" else 3e-3, warmup_steps=50 if o.preset == "demo" else 5,
            ttt_steps=3 if method == "eagle3" else 2, device=o.device, seed=o.seed,
            gen_sequences=o.drafter_gen_sequences, gen_prompt_len=min(64, o.drafter_seq_len // 4),
            eval_every=0, eval_prompts=o.eval_prompts, eval_tokens=min(o.eval_tokens, 64), save_every=1000,
            draft_vocab_size=size.draft_vocab_size if method == "eagle3" else None, progress=o.progress,
            vocab_sample_tokens=o.vocab_sample_tokens,
            max_data_tokens=20_000_000, restart="mtp" in o.force or "eagle3" in o.force,
        )
        summary = train_drafter(opts, documents=training_documents(self.work, o.seed, o))
        if method == "mtp":
            shutil.copy2(run_dir / "mtp.safetensors", self.model_dir / "mtp.safetensors")
        else:
            dest = self.model_dir / "eagle3"
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(run_dir / "model.safetensors", dest / "model.safetensors")
            config = json.loads((run_dir / "config.json").read_text())
            config["speculators_config"]["verifier"]["name_or_path"] = DEMO_NAME  # not this machine's path
            (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        self.record[method] = {k: v for k, v in summary.items() if k not in ("files", "out", "target")}
        self.save_record()

    def prompts(self) -> list[tuple[str, list[int]]]:
        """Held-out prompts for the measurements: the start of held-out files (raw) and the user
        turn of held-out chat examples (with the generation prompt)."""
        from verispec.loading.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(self.model_dir)
        held = load_corpus(self.work, "heldout", self.options)
        n = max(1, self.options.eval_prompts // 2)
        out = []
        for text in held["code"][:n]:
            out.append(("code", tok.encode(text)[:64]))
        for conv in held["chat"][:n]:
            user = conv.split("<|im_start|>assistant\n")[0]
            out.append(("chat", tok.encode(user + "<|im_start|>assistant\n")))
        return out

    def _weights_stamp(self) -> list:
        """What the select measurements depend on: the weights' sizes and times, the prompts' length."""
        stamp = []
        for name in ("model.safetensors", "mtp.safetensors", "eagle3/model.safetensors"):
            path = self.model_dir / name
            stamp.append([name, path.stat().st_size, path.stat().st_mtime_ns] if path.is_file() else [name])
        return stamp + [self.options.eval_tokens, self.options.eval_prompts, str(self.device)]

    def _device_label(self, dtype: str) -> str:
        """"cuda (NVIDIA H200, bfloat16)" / "cpu (2 threads, float32)": what a timing was taken on."""
        import torch

        if self.device.type == "cuda":
            return f"{self.device.type} ({torch.cuda.get_device_name(self.device)}, {dtype})"
        return f"{self.device.type} ({torch.get_num_threads()} threads, {dtype})"

    def stage_select(self) -> None:
        """Measure plain, MTP (depth 1-3) and EAGLE3 (1-4 drafts) decoding on held-out prompts with
        the engine as `verispec serve` runs it; the fastest speculative configuration becomes the default.

        Each configuration's row is saved as it is measured (work/select-partial.json), and past
        `select_seconds` the remaining ones are left for a rerun, which measures only those."""
        from verispec.config import EngineConfig
        from verispec.engine.engine import Engine
        from verispec.sampling.params import SamplingParams

        o = self.options
        prompts = self.prompts()
        partial_path = self.work / "select-partial.json"
        stamp = self._weights_stamp()
        partial = json.loads(partial_path.read_text()) if partial_path.is_file() else {}
        if partial.get("stamp") != stamp:
            partial = {"stamp": stamp, "rows": {}, "reference": None}
        rows = partial["rows"]
        params = SamplingParams(max_tokens=o.eval_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        measured_now = 0
        for name in SELECT_ORDER:
            if name in rows:
                continue
            if (o.select_seconds is not None and time.perf_counter() - t0 > o.select_seconds
                    and measured_now and len(rows) >= 2):
                break
            measured_now += 1
            method, _, depth = name.partition("-")
            kw = ({} if method == "ar" else {"mtp": True, "num_draft_tokens": int(depth)} if method == "mtp" else
                  {"eagle3": str(self.model_dir / "eagle3"), "num_draft_tokens": int(depth)})
            engine = Engine.load(EngineConfig(model=str(self.model_dir), device=o.device, **kw))
            engine.prewarm()
            generated = drafted = accepted = rounds = 0
            decode_s = 0.0
            outputs = []
            for _, ids in prompts:
                result = engine.generate_all(ids, params)
                st = result.stats
                generated += st.generated_tokens
                drafted, accepted, rounds = drafted + st.drafted, accepted + st.accepted, rounds + st.rounds
                decode_s += st.decode_ms / 1000
                outputs.append(result.token_ids)
            engine_dtype = str(engine.dtype).removeprefix("torch.")
            del engine
            if name == "ar":
                partial["reference"] = outputs
            reference = partial["reference"]
            same = f"{sum(a == b for a, b in zip(outputs, reference))}/{len(prompts)}" if reference else "n/a"
            rows[name] = {"config": name,
                          "decode_tok_per_s": round((generated - len(prompts)) / max(decode_s, 1e-9), 1),
                          "acceptance": round(accepted / drafted, 4) if drafted else None,
                          "tokens_per_round": round((generated - len(prompts)) / rounds, 3) if rounds else None,
                          "identical_to_plain_greedy": same, "device": self._device_label(engine_dtype)}
            partial_path.write_text(json.dumps(partial))
            r = rows[name]
            say(f"select: {name:9s} {r['decode_tok_per_s']:8.1f} tok/s  acceptance {r['acceptance']}  "
                f"tokens/round {r['tokens_per_round']}  identical {r['identical_to_plain_greedy']}")
        spec_rows = [rows[n] for n in SELECT_ORDER if n in rows and n != "ar"]
        if not spec_rows:
            say("select: no speculative configuration measured yet; rerun to continue")
            return
        best = max(spec_rows, key=lambda r: r["decode_tok_per_s"])
        method, _, depth = best["config"].partition("-")
        speculation = ({"method": "mtp", "mtp_depth": int(depth)} if method == "mtp" else
                       {"method": "eagle3", "eagle3": "eagle3", "draft_block": int(depth)})
        plain = rows["ar"]["decode_tok_per_s"] if "ar" in rows else None
        unmeasured = [n for n in SELECT_ORDER if n not in rows]
        why = (f"fastest measured: {best['config']} at {best['decode_tok_per_s']} tok/s vs plain {plain} tok/s "
               f"(greedy, {len(prompts)} held-out prompts x {o.eval_tokens} tokens, {self.device})"
               + (f"; not measured yet: {', '.join(unmeasured)}" if unmeasured else ""))
        # a default per device type: what pays on a GPU (captured drafter steps) and on a CPU (drafter
        # compute) differs; a select run on one device keeps the other's measurements and choice
        device_type = self.device.type
        earlier_path = self.model_dir / "demo.json"
        earlier = json.loads(earlier_path.read_text()) if earlier_path.is_file() else {}
        by_device = {k: v for k, v in (earlier.get("speculation_by_device") or {}).items() if k != device_type}
        why_by_device = {k: v for k, v in (earlier.get("why_by_device") or {}).items() if k != device_type}
        by_device[device_type], why_by_device[device_type] = speculation, why
        kept = [r for r in earlier.get("measurements", []) if row_device_type(r) != device_type]
        default_type = "cuda" if "cuda" in by_device else device_type
        demo = {"speculation": by_device[default_type], "why": why_by_device[default_type],
                "speculation_by_device": by_device, "why_by_device": why_by_device,
                "measurements": [rows[n] for n in SELECT_ORDER if n in rows] + kept, "unmeasured": unmeasured}
        (self.model_dir / "demo.json").write_text(json.dumps(demo, indent=2) + "\n")
        self.record["select"] = demo
        self.save_record()
        say(f"default speculation: {speculation} ({demo['why']})"
            + (" -- rerun the select stage to measure the rest" if unmeasured else ""))

    def samples(self) -> list[dict]:
        from verispec.demo.default import engine_config
        from verispec.engine.engine import Engine
        from verispec.sampling.params import SamplingParams

        engine = Engine.load(engine_config(self.model_dir, device=self.options.device))
        tok = engine.tokenizer
        cases = [
            ("raw", "def fibonacci(n):", 0.0),
            ("chat", "def fibonacci(n):", 0.0),
            ("chat", "Write a Python function `is_prime` that returns True if n is a prime number.", 0.0),
            ("raw", "import os\n\n\ndef list_python_files(root):\n", 0.0),
            ("raw", "class Stack:\n", 0.8),
        ]
        out = []
        for kind, prompt, temperature in cases:
            ids = (tok.encode(prompt) if kind == "raw" else
                   tok.chat_prompt_ids([{"role": "user", "content": prompt}])[1])
            params = SamplingParams(max_tokens=min(160, self.options.eval_tokens * 2), temperature=temperature,
                                    top_p=0.95 if temperature else 1.0, seed=0)
            result = engine.generate_all(ids, params)
            s = result.stats
            out.append({"kind": kind, "prompt": prompt, "temperature": temperature, "text": result.text,
                        "tokens": s.generated_tokens, "method": s.method,
                        "acceptance": round(s.accepted / s.drafted, 3) if s.drafted else None})
        return out

    def stage_card(self) -> None:
        samples = self.samples()
        self.record["samples"] = samples
        self.save_record()
        (self.model_dir / "README.md").write_text(model_card(self.record, self.options))
        out = Path(self.options.out)
        if out.resolve() != self.model_dir.resolve():
            copy_model(self.model_dir, out)
        total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        say(f"model written to {out} ({total / 1e6:.1f} MB)")
        if total > SHIP_LIMIT_BYTES:
            say(f"warning: {total / 1e6:.1f} MB is over the {SHIP_LIMIT_BYTES / 1e6:.0f} MB the package may ship")


def copy_model(src: Path, out: Path) -> None:
    """The shippable files of the finished model into `out` (files there from an earlier build
    that this one would write are replaced; nothing else there is touched)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (out / name).exists():
            (out / name).unlink()
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    if (out / "eagle3").is_dir():
        shutil.rmtree(out / "eagle3")
    if (src / "eagle3").is_dir():
        shutil.copytree(src / "eagle3", out / "eagle3")
