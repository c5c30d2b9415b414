"""verispec: a local OpenAI-compatible LLM server with lossless speculative decoding.

Python API:
    from verispec import LLM, SamplingParams
    llm = LLM("path/or/org-name")
    result = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=64, temperature=0))
"""
from __future__ import annotations

from verispec.sampling.params import SamplingParams
from verispec.engine.types import GenerationResult

__all__ = ["LLM", "SamplingParams", "GenerationResult"]
__version__ = "0.1.0"


class LLM:
    """Load a model once and generate from text prompts or chat messages."""

    def __init__(self, model: str | None = None, **engine_options):
        """`model`: a directory, hub id, .gguf file or `smollm2`; None: the default model (SmolLM2 with
        its drafter, see verispec/default_model.py), with its default dtype and speculation for the
        device, as `smollm2` gets them; without its wheel an error names the install command.
        One log line says which model runs."""
        from verispec import log
        from verispec.default_model import chosen_default
        from verispec.demo.default import default_device_type
        from verispec.engine.engine import load_engine

        chosen = chosen_default(model, default_device_type(engine_options.get("device")), fallback_to_demo=False)
        if chosen is not None:
            defaults = {**chosen.speculation, **({"dtype": chosen.dtype} if chosen.dtype else {})}
            log.info("LLM(): %s", chosen.note(dtype_applied="dtype" not in engine_options,
                                                speculation_applied=not {"eagle3", "mtp"} & set(engine_options)))
            model, engine_options = chosen.model, {**defaults, **engine_options}
        self.engine = load_engine(model, **engine_options)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompt: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None
                 ) -> GenerationResult | list[GenerationResult]:
        """One prompt (text or token ids) -> one result; a list of prompts -> their results, in
        order, generated together as one continuously scheduled batch."""
        single = isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
                                             and prompt)
        prompts = [prompt] if single else list(prompt)
        ids = [p if isinstance(p, list) else self.tokenizer.encode(p, add_special_tokens=True) for p in prompts]
        if isinstance(params, list) and single:
            params = params[0]
        results = self.engine.generate_batch(ids, params or SamplingParams())
        return results[0] if single else results

    def chat(self, messages: list[dict], params: SamplingParams | None = None,
             chat_template_kwargs: dict | None = None) -> GenerationResult:
        _, ids = self.tokenizer.chat_prompt_ids(messages, chat_template_kwargs)
        return self.engine.generate_all(ids, params or SamplingParams())
