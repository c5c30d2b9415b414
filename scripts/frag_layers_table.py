"""Print gpu_frag_gemv.py's per-layer times (its --out JSON) as one line per layer and tile."""
import json
import sys

rows = json.load(open(sys.argv[1]))["layers"]
for r in rows:
    if "error" in r:
        print(f"{r['layer']:8s} {r['variant']:28s} ERROR {r['error'][:200]}")
        continue
    print(f"{r['layer']:8s} {r['variant']:28s} " + " ".join(f"M{m} {r.get(f'us_M{m}', 0):7.2f}" for m in (1, 2, 4, 8)))
