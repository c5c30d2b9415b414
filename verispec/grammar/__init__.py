"""Constrained decoding: grammars (JSON schemas, tool-call syntax) as per-token masks over the logits.

The grammar library is llguidance (docs/grammar.md: measured against xgrammar); this package is
only the glue: building grammars from requests (spec.py), one matcher per sequence with the masks
of a speculative round (constraint.py), and the engine's use of them (verispec/engine/constrained.py).
"""
