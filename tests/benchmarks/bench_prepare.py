"""Prepare's peak memory on a large synthetic source against a source a tenth of its size.

    python tests/benchmarks/bench_prepare.py [--gb 2.0]

Writes a scored-pair CSV of about ``--gb`` GB (distinct sentences, a duplicate every 50 rows, 5 %
dev) and one a tenth of that, runs the prepare stage on each in its own process, and prints
their peak resident set size (kernel rusage of each child), wall time and rows per second. The
peer is prepare itself on the smaller source: ``RATIO prepare_peak_rss_large_vs_small`` near 1.0
means memory is flat in the source size (the stated bound is +64 MB, tests/test_prepare_memory.py).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_prepare_memory import peak_rss_mb, prepare_config  # noqa: E402

ROW_BYTES = 200  # what write_sts_source writes per row, about


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="Size of the large source in GB.")
    args = parser.parse_args()
    large_rows = int(args.gb * 1e9 / ROW_BYTES)
    tmp = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        results = {}
        for name, rows in (("small", large_rows // 10), ("large", large_rows)):
            config = prepare_config(tmp, name, rows)
            size_mb = (tmp / f"{name}.csv").stat().st_size / 1e6
            t0 = time.perf_counter()
            rss = peak_rss_mb(config, tmp / f"run-{name}")
            wall = time.perf_counter() - t0
            results[name] = rss
            print(f"prepare {name}: {rows:,} rows, {size_mb:,.0f} MB source: peak RSS {rss:,.0f} MB, "
                  f"{wall:,.1f} s ({rows / wall:,.0f} rows/s)", flush=True)
            shutil.rmtree(tmp / f"run-{name}", ignore_errors=True)
            (tmp / f"{name}.csv").unlink()
        print(f"RATIO prepare_peak_rss_large_vs_small={results['large'] / results['small']:.3f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
