#!/usr/bin/env python3
"""A load's resident memory at each start-up phase: VmRSS (now) and VmHWM (the peak so far) from
/proc/self/status as each `start-up:` line is logged, then after one short generation (Linux).

  python scripts/startup_memory.py                       # the default model on the CPU, plain
  python scripts/startup_memory.py --eagle3 verispec/drafters/smollm2-eagle3
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's verispec


def memory() -> str:
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                fields[line.split(":")[0]] = int(line.split()[1]) // 1024
    return f"{fields['VmRSS']:5d} MiB now, {fields['VmHWM']:5d} MiB peak"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default="smollm2")
    p.add_argument("--eagle3", default=None, help="an EAGLE3 drafter directory to load too")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float16")
    args = p.parse_args()
    from verispec import log

    logged = log.startup_phase

    def phase(name, seconds, *rest, **kwargs):
        print(f"{name[:48]:48s} {memory()}", flush=True)
        return logged(name, seconds, *rest, **kwargs)

    log.startup_phase = phase
    print(f"{'imports':48s} {memory()}", flush=True)
    from verispec.config import EngineConfig
    from verispec.engine.engine import Engine
    from verispec.sampling.params import SamplingParams

    engine = Engine.load(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, eagle3=args.eagle3))
    engine.generate_all(engine.tokenizer.encode("Name three colors."), SamplingParams(temperature=0.0, max_tokens=16))
    print(f"{'after a 16-token generation':48s} {memory()}", flush=True)


if __name__ == "__main__":
    main()
