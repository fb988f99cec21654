"""``python -m bench``: run every benchmark (by hand or ``make bench``; never in the test suite)."""

from bench import import_time, ledger_bench

if __name__ == "__main__":
    ledger_bench.main()
    import_time.main(["--out", "out/bench-import.json"])
