"""What `verispec bench` was asked to do, checked: one frozen object built from the CLI flags."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from verispec.bench.workloads import Workload
from verispec.errors import VerispecError


class Method(str, Enum):
    """Decoding methods the offline bench runs on our engine."""

    AR = "ar"  # plain autoregressive decoding
    EAGLE3 = "eagle3"  # EAGLE3 drafter (random of the real drafter shape, or --eagle3 DIR)
    MTP = "mtp"  # Qwen3.5/3.6's own MTP head (the checkpoint's, or random of its shape)
    SUFFIX = "suffix"  # model-free suffix decoding (spec/suffix.py): pays on the edit/quote/json workloads

    @property
    def speculative(self) -> bool:
        return self is not Method.AR


class Peer(str, Enum):
    """Other implementations `--compare` runs on the same model in the same run."""

    TRANSFORMERS = "transformers"  # Hugging Face transformers `generate`


class Endpoint(str, Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"


def _names(enum) -> str:
    return ", ".join(m.value for m in enum)


def parse_methods(text: str) -> list[Method]:
    out: list[Method] = []
    for name in _split(text, "--methods"):
        try:
            method = Method(name)
        except ValueError:
            raise VerispecError(f"--methods: '{name}' is not an available method "
                                f"(available: {_names(Method)})") from None
        if method not in out:
            out.append(method)
    return out


def parse_peers(text: str) -> list[Peer]:
    out: list[Peer] = []
    for name in _split(text, "--compare"):
        try:
            peer = Peer(name)
        except ValueError:
            raise VerispecError(f"--compare: '{name}' is not supported (available: {_names(Peer)})") from None
        if peer not in out:
            out.append(peer)
    return out


def parse_contexts(text: str) -> list[int]:
    out = []
    for item in _split(text, "--contexts"):
        value = item.lower()
        scale = 1
        if value.endswith("k"):  # 4k, 32k
            value, scale = value[:-1], 1024
        try:
            n = int(value) * scale
        except ValueError:
            raise VerispecError(f"--contexts: '{item}' is not a number of tokens (e.g. 512,4096,32k)") from None
        if n < 1:
            raise VerispecError(f"--contexts: every context must be >= 1 token, got {n}")
        if n not in out:
            out.append(n)
    return sorted(out)


def parse_concurrency(text: str) -> list[int]:
    out = []
    for item in _split(text, "--concurrency"):
        try:
            n = int(item)
        except ValueError:
            raise VerispecError(f"--concurrency: '{item}' is not a number of sequences (e.g. 1,8,32,64)") from None
        if n < 1:
            raise VerispecError(f"--concurrency: every value must be >= 1, got {n}")
        if n not in out:
            out.append(n)
    return sorted(out)


# `--json-schema builtin`: a record list long enough (minItems) that even a random model's output stays
# inside the grammar for every generated token, mixing strings, numbers, enums and nested arrays. No
# maxLength: llguidance masks a length-bounded string ~500x slower on a 152k vocabulary (docs/grammar.md),
# which scripts/gpu_grammar_measure.sh measures apart with its own schema file.
BUILTIN_SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 256, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                       "kind": {"enum": ["user", "group", "service"]}, "score": {"type": "number"},
                       "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["id", "name", "kind", "score", "tags"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}


def load_json_schema(value: str) -> dict:
    """--json-schema: "builtin" or a JSON file holding a schema object."""
    import json

    if value == "builtin":
        return BUILTIN_SCHEMA
    try:
        schema = json.loads(Path(value).read_text())
    except OSError as exc:
        raise VerispecError(f"--json-schema: cannot read {value}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise VerispecError(f"--json-schema: {value} is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise VerispecError(f"--json-schema: {value} must hold a JSON schema object")
    return schema


def parse_workload(text: str) -> Workload:
    try:
        return Workload(text)
    except ValueError:
        raise VerispecError(f"--workload: '{text}' is not a workload (available: {_names(Workload)})") from None


def _split(text: str, flag: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise VerispecError(f"{flag} needs at least one comma-separated value")
    return items


@dataclass(frozen=True)
class BenchOptions:
    # where to measure: exactly one of these (model/shape: offline; url/serve: over HTTP)
    model: str | None = None
    shape: str | None = None
    url: str | None = None
    serve: tuple[str, ...] = ()
    methods: tuple[Method, ...] = (Method.AR,)
    contexts: tuple[int, ...] = (512,)
    gen_tokens: int = 128
    repeats: int = 3
    draft_block: int = 2
    dtype: str | None = None
    device: str | None = None
    prefill_step_size: int = 2048
    numerics: str = "auto"  # offline: the engine's --numerics (auto | exact | fast)
    kv_cache_dtype: str = "auto"  # offline: the engine's --kv-cache-dtype (auto | fp8)
    cuda_graphs: bool = True  # the engine's captured decode/verify steps (CUDA with Triton)
    overlap_decode: bool = True  # plain steps queued ahead of the host's work (engine/overlap.py; with graphs)
    compare: tuple[Peer, ...] = ()
    out: Path | None = None
    bandwidth_tbs: float | None = None
    eagle3: str | None = None  # a real drafter directory (offline)
    step_iters: int = 50  # timed rounds of (decode, verify, draft) per context for the speculative cost rows
    endpoint: Endpoint = Endpoint.CHAT
    api_key: str | None = None
    serve_timeout_s: float = 900.0
    request_timeout_s: float = 900.0
    seed: int = 0
    concurrency: tuple[int, ...] = ()  # offline: batches of N sequences at once; HTTP: N concurrent clients
    quant: str | None = None  # offline: quantize the target's weights first (verispec/quant/in_memory.py)
    json_schema: str | None = None  # offline: also measure every run under this schema (a file, or "builtin")
    prefix_cache: bool = False  # offline: measure the prefix cache instead (bench/prefix.py)
    workload: Workload = Workload.RANDOM  # what the prompts ask for (bench/workloads.py)
    write_draft_costs: Path | None = None  # offline: time verify/draft passes into a draft-cost table here
    draft_schedule: str | None = None  # offline: the engine's --draft-schedule ("adaptive": its default choice)
    tensor_parallel_size: int = 1  # offline -m: the checkpoint split over this many GPUs (docs/multi-gpu.md)

    @property
    def http(self) -> bool:
        return bool(self.url or self.serve)

    def check(self) -> "BenchOptions":
        for flag, value in (("--gen-tokens", self.gen_tokens), ("--repeats", self.repeats),
                            ("--num-draft-tokens", self.draft_block), ("--prefill-step-size", self.prefill_step_size),
                            ("--step-iters", self.step_iters)):
            if value < 1:
                raise VerispecError(f"{flag} must be >= 1, got {value}")
        if self.bandwidth_tbs is not None and self.bandwidth_tbs <= 0:
            raise VerispecError(f"--bandwidth must be a positive number of TB/s, got {self.bandwidth_tbs}")
        if self.json_schema is not None and self.http:
            raise VerispecError("--json-schema is measured offline (-m / --shape), not over HTTP")
        if self.json_schema is not None:
            load_json_schema(self.json_schema)  # a bad file fails before any work
        if self.prefix_cache and (self.compare or self.json_schema is not None):
            raise VerispecError("--prefix-cache is measured without --compare or --json-schema")
        if self.prefix_cache and self.http and self.endpoint is not Endpoint.CHAT:
            raise VerispecError("--prefix-cache over HTTP replays chat conversations: use --endpoint chat")
        if self.workload is not Workload.RANDOM and self.shape:
            raise VerispecError(f"--workload {self.workload.value} asks a model to copy text: it needs a checkpoint's "
                                "tokenizer (-m MODEL, --url or --serve), not random --shape weights")
        if self.workload is not Workload.RANDOM and self.prefix_cache:
            raise VerispecError("--prefix-cache replays its own conversations: use it without --workload")
        if self.write_draft_costs is not None and (self.http or not self.methods or
                                                   not any(m.speculative for m in self.methods)):
            raise VerispecError("--write-draft-costs times a proposer's passes offline: use it with -m / --shape "
                                "and a speculative --methods (eagle3, mtp, suffix)")
        if self.draft_schedule not in (None, "adaptive"):
            if self.http:
                raise VerispecError("--draft-schedule is for offline runs; over HTTP the server's flags pick it")
            from verispec.engine.draft_schedule import DraftSchedule

            DraftSchedule.parse(self.draft_schedule, self.draft_block)
        if self.tensor_parallel_size != 1 and not (self.model or self.shape):
            raise VerispecError("--tensor-parallel-size is for offline runs (-m or --shape); over HTTP give it to "
                                "the server")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise VerispecError(f"--url '{self.url}' must start with http:// or https://")
        return self
