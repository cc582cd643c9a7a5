"""Benchmarks against other engines, differential tests against vLLM, guidellm runs and
experiments: ``python -m benchmarks NAME ...`` from the repository root runs
``benchmarks.NAME.main(argv)``. Not part of the wheel: it imports pagedserve, never the
other way (tests/test_boundaries.py). What an operator runs against their own deployment
stays in ``pagedserve bench``."""
from __future__ import annotations

# pagedserve takes the repository root off sys.path (its top-level kernels/ would shadow
# the `kernels` package transformers imports); this package, once imported, finds its
# modules through its own __path__.
import pagedserve  # noqa: F401
