"""What a request asks for (SamplingParams) and how logits become tokens: shared by the engine and
the drafters, so neither imports the other for it."""
