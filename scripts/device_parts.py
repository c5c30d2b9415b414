#!/usr/bin/env python3
"""Split a file too large for one device call (e.g. the 98 MB SmolLM2 GGUF; a call's working tree
travels with at most 64 MiB) into parts that each fit beside what always travels, and print the
device calls that bring them over.

Why parts: the GPU machine reaches no network, so the file must travel in `carry`; a warm machine
keeps /tmp between calls made within ~30 s of each other, so the first calls stash parts in
/tmp (`scripts/gpu_smollm2_drafter.sh stash`) and the last one joins them (checked by sha256).

The room per call is measured: 64 MiB minus what travels anyway (tracked files and untracked
files git does not ignore) minus the other carried paths (--also, e.g. .whl) minus a margin.

  python scripts/device_parts.py FILE --out build/device-parts --also .whl
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

LIMIT = 64 * 2 ** 20
MARGIN = 2 ** 20  # the tool's own count may differ a little (directories, metadata)


def travelling_bytes(repo: Path) -> int:
    """Bytes of the files a device call sends anyway: tracked + untracked-not-ignored."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            check=True, capture_output=True).stdout.split(b"\0")
    total = 0
    for name in filter(None, listed):
        path = repo / name.decode()
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file")
    p.add_argument("--out", required=True, help="directory for the parts (inside the repo, ignored by git)")
    p.add_argument("--also", nargs="*", default=[], help="other paths carried in the last call (e.g. .whl)")
    args = p.parse_args(argv)

    repo = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], check=True, capture_output=True,
                               text=True).stdout.strip())
    out = Path(args.out).resolve()
    if subprocess.run(["git", "check-ignore", "-q", str(out)], cwd=repo).returncode != 0:
        sys.exit(f"{out} is not ignored by git: it would travel in every call; pick a path under build/")
    base = travelling_bytes(repo)
    also = sum(tree_bytes(repo / a) for a in args.also)
    room = LIMIT - base - MARGIN
    room_last = room - also
    data = Path(args.file).read_bytes()
    if room_last < 2 ** 20:
        sys.exit(f"only {room_last / 2 ** 20:.1f} MiB are left per call ({base / 2 ** 20:.1f} MiB of files travel "
                 "anyway): make the working tree smaller first")
    # the last call carries --also too, so it takes the smaller part
    sizes, left = [], len(data) - min(len(data), room_last)
    while left > 0:
        sizes.append(min(room, left))
        left -= sizes[-1]
    sizes.append(len(data) - sum(sizes))
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("p*"):
        for f in old.glob("*"):
            f.unlink()
        old.rmdir()
    parts, offset = [], 0
    for i, size in enumerate(sizes, 1):
        folder = out / f"p{i}"
        folder.mkdir()
        (folder / f"part{i:02d}").write_bytes(data[offset:offset + size])
        offset += size
        parts.append(str(folder.relative_to(repo)))
    manifest = {"name": Path(args.file).name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                "parts": len(parts)}
    (out / f"p{len(parts)}" / "manifest.json").write_text(json.dumps(manifest) + "\n")
    print(f"{len(data) / 2 ** 20:.1f} MiB in {len(parts)} parts ({base / 2 ** 20:.1f} MiB travel anyway, "
          f"{room / 2 ** 20:.1f} MiB of room per call); make these calls back to back (a machine stays warm ~30 s):")
    for i, part in enumerate(parts, 1):
        carry = [part] + (list(args.also) if i == len(parts) else [])
        print(f"  call {i}: carry {json.dumps(carry)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
