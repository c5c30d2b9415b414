"""How long one suffix-decoding lookup takes as the shared cache of finished outputs grows: a
sequence's 500-token index beside a cache of N outputs of 100 random tokens (spec/suffix_index.py).

    python scripts/suffix_index_bench.py --outputs 1,100,1000,4000
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


if __name__ == "__main__":
    main()
