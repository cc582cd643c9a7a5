"""Benchmarks: `pagedserve bench NAME` runs `pagedserve.bench.NAME.main(argv)`."""
