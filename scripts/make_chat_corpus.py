#!/usr/bin/env python3
"""Build an offline chat corpus for training a drafter of a chat model (no download, no dataset):
user requests generated from topic lists x task templates, rendered with the target's own chat
template, written where `verispec train-drafter` reads them.

Why generated requests: the GPU machines reach no network and carry no datasets, and what a chat
drafter must learn is the target's *answers* to chat prompts; `train-drafter --gen-prompts`
makes the target write those answers itself, so the prompts only need to be varied (many topics,
task kinds, programming languages, numbers), not written by people.

Writes into --out:
  train.jsonl     one {"prompt": rendered chat prompt, "request": the user text} per line
                  (for `train-drafter --gen-prompts`)
  heldout.jsonl   the held-out prompts, never trained on (acceptance is measured on them)
  text/requests.txt   every training request rendered as a chat prompt, one document per prompt
                  (for `train-drafter --data`: the target's predictions over chat-formatted text)
  stats.json      counts per task kind

Usage (the tokenizer comes from the target, e.g. the GGUF of `-m smollm2`):
  python scripts/make_chat_corpus.py -m smollm2 --out build/smollm2-corpus
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import zlib
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOPICS = (
    "photosynthesis", "black holes", "the water cycle", "plate tectonics", "vaccines", "the immune system",
    "climate change", "renewable energy", "solar panels", "wind turbines", "nuclear fission", "electric cars",
    "the stock market", "inflation", "interest rates", "supply and demand", "compound interest", "budgeting",
    "the French Revolution", "the Roman Empire", "ancient Egypt", "the Renaissance", "the Industrial Revolution",
    "World War I", "the Cold War", "the printing press", "the Silk Road", "the Moon landing",
    "machine learning", "neural networks", "databases", "the internet", "encryption", "blockchains",
    "operating systems", "compilers", "cloud computing", "version control", "unit testing", "recursion",
    "sorting algorithms", "hash tables", "binary search", "graph algorithms", "regular expressions",
    "sleep", "nutrition", "exercise", "meditation", "stress", "hydration", "vitamins", "the human heart",
    "the brain", "memory", "habits", "motivation", "time management", "public speaking", "negotiation",
    "job interviews", "writing a resume", "learning a language", "studying for exams", "note taking",
    "gardening", "composting", "houseplants", "baking bread", "making coffee", "cooking rice", "fermentation",
    "dogs", "cats", "bees", "whales", "coral reefs", "rainforests", "deserts", "volcanoes", "earthquakes",
    "hurricanes", "the seasons", "rainbows", "the speed of light", "gravity", "magnetism", "electricity",
    "batteries", "semiconductors", "lasers", "telescopes", "the periodic table", "chemical reactions",
    "DNA", "evolution", "genetics", "cells", "bacteria", "viruses", "antibiotics", "the solar system",
    "Mars", "the Sun", "comets", "chess", "football", "the Olympic Games", "jazz", "classical music",
    "poetry", "novels", "photography", "painting", "architecture", "bridges", "skyscrapers", "trains",
    "airplanes", "rockets", "satellites", "GPS", "smartphones", "social media", "privacy online",
    "passwords", "remote work", "teamwork", "leadership", "customer service", "marketing", "startups",
    "democracy", "elections", "human rights", "urban planning", "recycling", "plastic pollution",
    "water purification", "agriculture", "bees and pollination", "coffee farming", "tea", "chocolate",
)

TOPIC_TASKS = (
    "Explain {t} in simple terms.", "What is {t}?", "Give me a short overview of {t}.",
    "Explain {t} to a ten-year-old.", "Write a short paragraph about {t}.", "List five facts about {t}.",
    "What are the main benefits of {t}?", "What are common misconceptions about {t}?",
    "Summarize the history of {t} in a few sentences.", "Why is {t} important?",
    "Write three quiz questions about {t}, with answers.", "Give me a one-sentence definition of {t}.",
    "Write a haiku about {t}.", "Write a short poem about {t}.", "Write a tweet about {t}.",
    "What should a beginner know about {t}?", "Describe {t} in three bullet points.",
    "What are the pros and cons of {t}?", "Tell me an interesting story involving {t}.",
    "How would you teach {t} to a class of students?", "What questions do people often ask about {t}?",
    "Write a short blog post introduction about {t}.", "Explain {t} using an analogy.",
    "What is the difference between {t} and {u}?", "Compare {t} and {u} in a short table.",
    "How are {t} and {u} related?",
)

HOW_TO = (
    "How do I make a good cup of tea?", "How do I change a flat tire?", "How do I start running?",
    "How can I sleep better?", "How do I write a cover letter?", "How can I save money on groceries?",
    "How do I learn to touch type?", "How do I prepare for a job interview?", "How do I keep houseplants alive?",
    "How do I boil an egg?", "How do I plan a trip on a budget?", "How do I stop procrastinating?",
    "How do I back up my computer?", "How do I make a strong password?", "How can I improve my handwriting?",
    "How do I set up a Python virtual environment?", "How do I use git to undo a commit?",
    "How do I center a div in CSS?", "How can I make my code easier to read?", "How do I read a CSV file in Python?",
    "How do I write a good email to my manager?", "How can I be more productive when working from home?",
    "How do I clean a cast iron pan?", "How do I make pancakes?", "How do I learn to play the guitar?",
    "How can I reduce my screen time?", "How do I train my dog to sit?", "How do I start a vegetable garden?",
    "How can I remember names better?", "How do I give constructive feedback?",
)

LANGUAGES = ("Python", "JavaScript", "TypeScript", "Java", "C", "C++", "Go", "Rust", "Ruby", "Bash", "SQL", "Kotlin")
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "finds the largest element of a list", "counts the words in a text",
    "removes duplicates from a list", "checks whether a string is a palindrome", "sorts a list with bubble sort",
    "merges two sorted lists", "implements binary search", "converts Celsius to Fahrenheit",
    "computes the greatest common divisor of two numbers", "flattens a nested list", "counts vowels in a string",
    "reads a file and prints its lines", "finds the second largest number in a list", "sums the digits of a number",
    "checks whether two strings are anagrams", "generates the first n prime numbers", "transposes a matrix",
    "validates an email address", "capitalizes every word in a sentence", "computes the average of a list",
    "implements a stack", "implements a queue", "finds the most frequent element in a list",
    "converts a decimal number to binary", "checks whether a year is a leap year", "rotates an array by k positions",
)
CODE_TEMPLATES = (
    "Write a {lang} function that {task}.", "Show me how to write a {lang} program that {task}.",
    "In {lang}, write code that {task}, with a short explanation.", "Write a {lang} function that {task}, with comments.",
)
CODE_QUESTIONS = (
    "What does this {lang} code do?\n\n{snippet}", "Explain this {lang} snippet line by line:\n\n{snippet}",
    "Is there a bug in this {lang} code?\n\n{snippet}",
)
SNIPPETS = {
    "Python": ("for i in range(10):\n    print(i * i)", "def f(xs):\n    return [x for x in xs if x % 2 == 0]",
               "d = {}\nfor w in text.split():\n    d[w] = d.get(w, 0) + 1", "x = sorted(items, key=len)[-1]"),
    "JavaScript": ("const total = items.reduce((a, b) => a + b, 0);", "for (let i = 0; i <= arr.length; i++) {\n  console.log(arr[i]);\n}",
                   "const names = users.map(u => u.name).filter(Boolean);"),
    "SQL": ("SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 5;",
            "SELECT * FROM users WHERE created_at > '2024-01-01' ORDER BY created_at DESC LIMIT 10;"),
    "C": ("int sum = 0;\nfor (int i = 0; i < n; i++) sum += a[i];", "char *s = malloc(10);\nstrcpy(s, \"hello world\");"),
}

SENTENCES = (
    "The weather is nice today.", "Where is the train station?", "I would like a cup of coffee, please.",
    "My brother is a doctor.", "We are going to the beach tomorrow.", "This book is very interesting.",
    "Can you help me?", "I have been learning to cook.", "The meeting starts at nine o'clock.",
    "Thank you for your help.", "How much does this cost?", "I lost my keys yesterday.",
    "The children are playing in the park.", "She works at a hospital.", "It is raining again.",
    "Please close the window.", "I don't understand the question.", "Our flight was delayed by two hours.",
)
TARGET_LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch")
REWRITE_TEMPLATES = (
    "Rewrite this sentence to sound more formal: \"{s}\"", "Rewrite this sentence in the past tense: \"{s}\"",
    "Make this sentence more polite: \"{s}\"", "Correct the grammar if needed: \"{s}\"",
    "Rewrite this sentence as a question: \"{s}\"", "Paraphrase: \"{s}\"",
)
SUMMARY_TEXTS = (
    "The city council met on Tuesday to discuss the new park. Residents asked for more trees, a playground and "
    "better lighting. The council agreed to fund the playground this year and to review the other requests in the "
    "spring, after a survey of the neighbourhood.",
    "Our team shipped the new search feature last week. Early numbers show that users find what they want faster, "
    "but some reported slow results on mobile. Next sprint we will profile the mobile client and add caching.",
    "Bees pollinate about a third of the crops we eat. Their numbers have fallen in many regions because of "
    "pesticides, disease and the loss of wild flowers. Farmers and gardeners can help by planting flowers and "
    "using fewer chemicals.",
    "The company reported higher revenue than expected, driven by strong sales of its cloud services. Costs also "
    "rose because of new hiring. The shares rose five percent after the announcement.",
)
NAMES = ("Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemal", "Lena")
ITEMS = ("apples", "books", "pencils", "stickers", "marbles", "cookies", "cards", "stamps")
SYSTEM_PROMPTS = (None, None, None, "You are a helpful assistant.", "You are a concise assistant.",
                  "You are a friendly tutor who explains things step by step.")


def math_problems(rng: random.Random, count: int) -> list[str]:
    out = []
    for _ in range(count):
        a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 9)
        name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
        out.append(rng.choice((
            f"{name} has {a} {item} and gives {b} to {other}. How many {item} does {name} have left?",
            f"{name} buys {c} boxes of {item} with {b} {item} in each box. How many {item} is that in total?",
            f"A train travels {a * 10} km in {c} hours. What is its average speed?",
            f"What is {a} times {b}, plus {c}?", f"Solve for x: {c}x + {b} = {c * a + b}.",
            f"A shirt costs ${a} and is on sale for {c * 5}% off. What is the sale price?",
            f"{name} reads {b} pages a day. How many days to finish a book of {b * a} pages?",
            f"What is {c * 5}% of {a * 10}?", f"Is {a * b + 1} a prime number? Explain.",
            f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        )))
    return out


def requests(seed: int) -> list[tuple[str, str]]:
    """(kind, user request) pairs, deduplicated, in a seeded order."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    for t in TOPICS:
        for template in TOPIC_TASKS:
            if "{u}" in template:
                u = rng.choice([x for x in TOPICS if x != t])
                out.append(("compare", template.format(t=t, u=u)))
            else:
                out.append(("explain", template.format(t=t)))
    out.extend(("how-to", q) for q in HOW_TO)
    for lang in LANGUAGES:
        for task in CODE_TASKS:
            out.append(("code", rng.choice(CODE_TEMPLATES).format(lang=lang, task=task)))
    for lang, snippets in SNIPPETS.items():
        for snippet in snippets:
            for template in CODE_QUESTIONS:
                out.append(("code-read", template.format(lang=lang, snippet=snippet)))
    for s in SENTENCES:
        for target in TARGET_LANGUAGES:
            out.append(("translate", f"Translate into {target}: \"{s}\""))
        for template in REWRITE_TEMPLATES:
            out.append(("rewrite", template.format(s=s)))
    for text in SUMMARY_TEXTS:
        for ask in ("Summarize this in one sentence:", "Summarize the following text:",
                    "What are the key points of this text?", "Write a headline for this text:"):
            out.append(("summarize", f"{ask}\n\n{text}"))
    out.extend(("math", q) for q in math_problems(rng, 600))
    seen, unique = set(), []
    for kind, text in out:
        if text not in seen:
            seen.add(text)
            unique.append((kind, text))
    rng.shuffle(unique)
    return unique


def is_heldout(text: str, every: int) -> bool:
    # by content, not position: the split stays the same when the lists above grow
    return zlib.crc32(text.encode()) % every == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", required=True, help="the target whose chat template renders the prompts "
                                                        "(a model directory, a .gguf file, or smollm2)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout-every", type=int, default=25, help="about one request in N is held out (default 25)")
    p.add_argument("--max-requests", type=int, default=None, help="keep only the first N requests (tiny test runs)")
    args = p.parse_args(argv)

    from verispec.loading.resolve import resolve_model
    from verispec.loading.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model(args.model))
    rng = random.Random(args.seed + 1)
    pairs = requests(args.seed)[:args.max_requests]
    out = Path(args.out)
    (out / "text").mkdir(parents=True, exist_ok=True)
    train, heldout, counts = [], [], Counter()
    for kind, text in pairs:
        system = rng.choice(SYSTEM_PROMPTS)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        row = {"kind": kind, "request": text, "prompt": tokenizer.render_chat(messages)}
        (heldout if is_heldout(text, args.heldout_every) else train).append(row)
        counts[kind] += 1
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", heldout)):
        (out / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    # one document per prompt, separated by the tokenizer's end-of-text when train-drafter joins them
    (out / "text" / "requests.txt").write_text("\n".join(r["prompt"] for r in train))
    stats = {"requests": len(pairs), "train": len(train), "heldout": len(heldout), "by_kind": dict(counts),
             "seed": args.seed}
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(f"{len(train)} training and {len(heldout)} held-out chat prompts in {out} ({dict(counts)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
