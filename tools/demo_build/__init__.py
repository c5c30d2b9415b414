"""The embedded demo model's build pipeline (corpus, tokenizer, pretraining, drafters, selection,
card): scripts/train_demo_model.py runs it; the runtime only reads its output, verispec/demo/model."""
