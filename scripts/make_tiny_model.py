"""Build the placeholder default model for `make serve`: a tiny random-weight Qwen3-architecture
checkpoint with a BPE tokenizer trained on Python standard-library source and a ChatML template.

It exists so the server can start on a fresh machine with no model hub; its text is noise.
The trained demo model (a later issue) replaces it.
"""
import argparse

from verispec.demo.tiny import build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model-type", default="qwen3")
    args = parser.parse_args()
    build_tiny_model(args.out, args.model_type, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     max_position_embeddings=4096)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
