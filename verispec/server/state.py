"""What the app owns (the engine and its bridge, metrics, names) and the fields every response shares."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from importlib import metadata

from verispec.engine.client import EngineClient
from verispec.server.bridge import EngineBridge
from verispec.server.engine_stats import EngineStatsReader
from verispec.server.metrics import ServerMetrics
from verispec.server.token_budget import PromptBudget


def _version() -> str:
    try:
        return metadata.version("verispec")
    except metadata.PackageNotFoundError:
        return "dev"


@dataclass
class ServerState:
    engine: EngineClient  # Engine, EngineProcess, or a test double: engine/client.py
    served_model_name: str
    bridge: EngineBridge
    prompt_budget: PromptBudget  # prompts that cannot fit the context, refused before full tokenization
    engine_stats: EngineStatsReader  # the engine's load for /metrics, read off the event loop
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    started_at: int = field(default_factory=lambda: int(time.time()))
    system_fingerprint: str = field(default_factory=lambda: f"verispec-{_version()}")

    def response_header(self, id_prefix: str, object_name: str) -> dict:
        """id/object/created/model/system_fingerprint, the same on every chunk of one response."""
        return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": object_name, "created": int(time.time()),
                "model": self.served_model_name, "system_fingerprint": self.system_fingerprint}


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache supplied."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}
