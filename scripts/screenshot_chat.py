"""Takes docs/chat.png: the chat page in headless Chromium, against the chat page tests' setup
(a live server on the tiny test tokenizer, with PacedEngine playing a scripted speculative reply:
the tiny random test model itself writes noise).

    python scripts/screenshot_chat.py [--out docs/chat.png] [--width 1000 --height 760]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "server")]

QUESTION = "Write a Python function that returns the n-th Fibonacci number."
REASONING = "The user wants a function. An iterative loop is O(n) and avoids recursion limits."
ANSWER = ("Here is an **iterative** version, which runs in O(n) time and O(1) memory:\n\n"
          "```python\ndef fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
          "    return a\n```\n\n"
          "- `fibonacci(0)` is 0 and `fibonacci(10)` is 55.\n"
          "- For very large *n*, the fast-doubling method needs only O(log n) steps.")


def script() -> list:
    from paced_engine import Piece, rounds_of

    thinking = [Piece("<think>", 1, 0)] + rounds_of(REASONING, [2, 3, 1, 0, 3])[0:] + [Piece("</think>", 1, 0)]
    return thinking + rounds_of(ANSWER, [3, 2, 3, 0, 1, 3, 2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "chat.png"))
    parser.add_argument("--width", type=int, default=1000)
    parser.add_argument("--height", type=int, default=760)
    args = parser.parse_args()
    from browser import chromium, find_browser
    from paced_engine import PacedEngine
    from server_helpers import live_server
    from tools.tiny import build_tiny_model
    from verispec.loading.tokenizer import Tokenizer
    from verispec.server.app import create_app

    found = find_browser()
    if isinstance(found, str):
        sys.exit(f"screenshot_chat.py: {found}")
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model(tmp, "qwen3")
        engine = PacedEngine(Tokenizer.from_dir(tmp), method="eagle3", num_drafts=3)
        engine.model_name = "scripted-reply"
        engine.script = script()
        engine.delay_s = 0.02
        with live_server(create_app(engine, "scripted-reply")) as server, \
                chromium(*found, width=args.width, height=args.height) as web:
            web.get(server.url + "/")
            web.find_element("id", "prompt").send_keys(QUESTION)
            web.find_element("id", "send").click()
            deadline = time.monotonic() + 30
            while web.execute_script("return document.querySelector('.message.assistant')?.dataset.state") != "done":
                if time.monotonic() > deadline:
                    sys.exit("screenshot_chat.py: the reply did not finish")
                time.sleep(0.1)
            web.save_screenshot(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
