"""Build a tiny random-weight checkpoint (`make model`): Qwen3 architecture by default, with a BPE
tokenizer trained on Python standard-library source and a ChatML template.

It lets the server start on a machine with no model hub and no download; its text is noise.
"""
import argparse
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write the checkpoint into")
    parser.add_argument("--model-type", default="qwen3", help="a transformers model_type (default: qwen3)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ lives beside verispec/
    from tools.tiny import build_tiny_model

    build_tiny_model(args.out, args.model_type, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     max_position_embeddings=4096)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
