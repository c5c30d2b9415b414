"""How long one suffix-decoding lookup takes as the shared cache of finished outputs grows: a
sequence's 500-token index beside a cache of N outputs of 100 random tokens (spec/suffix_index.py);
then what adding an output costs a full cache (the default 2^18 tokens), evicting as it goes: the
mean, and the worst (a rebuild that drops the evicted outputs' entries).

    python scripts/suffix_index_bench.py --outputs 1,100,1000,4000 --churn 8000
"""
from __future__ import annotations

import argparse
import random
import time

from verispec.spec.suffix import OutputCache
from verispec.spec.suffix_index import SuffixIndex, find_matches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outputs", default="1,100,1000,4000", help="cache sizes to time, comma-separated")
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--churn", type=int, default=8000, help="outputs added to a full cache (0: skip)")
    args = parser.parse_args()
    rng = random.Random(0)
    for count in (int(n) for n in args.outputs.split(",")):
        cache = OutputCache(1 << 22, max(count, 1))
        for _ in range(count):
            cache.add([rng.randrange(2000) for _ in range(100)])
        own = SuffixIndex()
        sequence = [rng.randrange(2000) for _ in range(500)]
        own.extend(0, sequence)
        start = time.perf_counter()
        for i in range(args.lookups):
            find_matches([own, cache.index], sequence + [sequence[i % 400]], 1, 32, 32)
        seconds = (time.perf_counter() - start) / args.lookups
        runs = sum(len(r) for r in cache.index._runs.values())
        print(f"{count:>5} cached outputs ({runs} sorted runs): {seconds * 1e6:,.0f} us a lookup", flush=True)
    if args.churn:
        cache, times = OutputCache(1 << 18, 4096), []
        for _ in range(args.churn):
            tokens = [rng.randrange(2000) for _ in range(100)]
            start = time.perf_counter()
            cache.add(tokens)
            times.append(time.perf_counter() - start)
        print(f"{args.churn} outputs through a {1 << 18}-token cache: {sum(times) / len(times) * 1e3:.2f} ms an add, "
              f"the worst {max(times) * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
