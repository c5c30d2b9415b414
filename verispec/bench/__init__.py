"""`verispec bench`: decode speed against the bandwidth roofline, offline or over HTTP.

Offline (`-m MODEL` or `--shape NAME`) runs our engine in this process (offline.py; it never
imports the server). HTTP (`--url` or `--serve`) measures any OpenAI-compatible server (http.py).
Both produce a BenchReport, written as bench.json / bench.md / bench.png (report.py).
"""
from __future__ import annotations

import sys

from verispec.bench.options import BenchOptions
from verispec.bench.report import BenchReport, markdown, write_outputs


def run_bench(opts: BenchOptions) -> BenchReport:
    """Measure, write the files asked for, print the Markdown table to stdout."""
    opts.check()
    if opts.prefix_cache:
        from verispec.bench.prefix import run_prefix, run_prefix_http

        report = run_prefix_http(opts) if opts.http else run_prefix(opts)
    elif opts.http:
        from verispec.bench.http import run_http

        report = run_http(opts)
    else:
        from verispec.bench.offline import run_offline

        report = run_offline(opts)
    if opts.out is not None:
        for path in write_outputs(report, opts.out):
            sys.stderr.write(f"verispec bench: wrote {path}\n")
    sys.stdout.write(markdown(report))
    sys.stdout.flush()
    return report
