"""Benchmarks an operator runs against their own deployment: `pagedserve bench NAME` runs
`pagedserve.bench.NAME.main(argv)` (throughput, serving, and the components'
micro-benchmarks). Comparisons with other engines live outside the wheel, in the
repository's benchmarks/ (`python -m benchmarks NAME`)."""
