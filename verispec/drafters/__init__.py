"""Drafters shipped with verispec as package data, for the default model (verispec/default_model.py).

`smollm2-eagle3/`: the EAGLE3 drafter of SmolLM2-135M-Instruct (speculators format, as
`verispec train-drafter` writes it) and its `speculation.json` (the per-device default, measured by
scripts/measure_speculation.py). Until it is trained (scripts/gpu_smollm2_drafter.sh), the
directory holds only its README and the default model decodes plain, saying why in the log.
"""
