"""Seeded synthetic request-length workloads shaped like the paper's traces.

The paper samples ShareGPT (mean 161.31 input / 337.99 output tokens, long
tailed) and Alpaca (19.31 / 58.45, short). We draw input and output lengths
from independent lognormals, clip them (input to [1, 1024], output to
[1, 2048 - input], so no request exceeds the 2048-token context), and solve
for the lognormal location that puts the *clipped* means on the paper's
means. The spreads (sigma) are our choice: ShareGPT is wide, Alpaca narrow.
Same seed, same list, on every machine (numpy's PCG64).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

MAX_MODEL_LEN = 2048
MAX_PROMPT_LEN = 1024


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    mean_in: float
    mean_out: float
    sigma_in: float
    sigma_out: float


SPECS = {
    "sharegpt": WorkloadSpec("sharegpt", 161.31, 337.99, sigma_in=1.1, sigma_out=0.9),
    "alpaca": WorkloadSpec("alpaca", 19.31, 58.45, sigma_in=0.6, sigma_out=0.8),
}


@dataclass(frozen=True)
class RequestLen:
    prompt_len: int
    output_len: int

    @property
    def total(self) -> int:
        return self.prompt_len + self.output_len


def _clipped(z: np.ndarray, mu: float, sigma: float, upper: np.ndarray | float) -> np.ndarray:
    return np.clip(np.rint(np.exp(mu + sigma * z)), 1, upper)


def _solve_mu(z: np.ndarray, sigma: float, target: float, upper: np.ndarray | float) -> float:
    """Location whose clipped, rounded lognormal has mean ``target`` on ``z``."""
    lo, hi = math.log(target) - 3 * sigma * sigma - 2, math.log(target) + 2
    for _ in range(60):
        mid = (lo + hi) / 2
        if _clipped(z, mid, sigma, upper).mean() < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@functools.lru_cache(maxsize=None)
def _calibrated(name: str) -> tuple[float, float]:
    spec = SPECS[name]
    rng = np.random.default_rng(12345)  # fixed calibration sample
    z_in, z_out = rng.standard_normal(200_000), rng.standard_normal(200_000)
    mu_in = _solve_mu(z_in, spec.sigma_in, spec.mean_in, MAX_PROMPT_LEN)
    upper_out = MAX_MODEL_LEN - _clipped(z_in, mu_in, spec.sigma_in, MAX_PROMPT_LEN)
    mu_out = _solve_mu(z_out, spec.sigma_out, spec.mean_out, upper_out)
    return mu_in, mu_out


def sample_lengths(name: str, n: int, seed: int = 0) -> list[RequestLen]:
    """``n`` (prompt_len, output_len) pairs of workload ``name``."""
    if name not in SPECS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(SPECS)}")
    spec = SPECS[name]
    mu_in, mu_out = _calibrated(name)
    z = np.random.default_rng(seed).standard_normal((n, 2))  # row i is request i: prefixes agree
    p = _clipped(z[:, 0], mu_in, spec.sigma_in, MAX_PROMPT_LEN)
    o = _clipped(z[:, 1], mu_out, spec.sigma_out, MAX_MODEL_LEN - p)
    return [RequestLen(int(a), int(b)) for a, b in zip(p, o)]


def sharegpt_like(n: int, seed: int = 0) -> list[RequestLen]:
    return sample_lengths("sharegpt", n, seed)


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s) of a Poisson process with ``rate`` requests/s."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.cumsum(gaps).tolist()


def synthetic_prompt(length: int, seed: int, vocab_size: int = 32000) -> list[int]:
    """Token ids for a prompt of ``length`` (distinct seeds: distinct prompts)."""
    return np.random.default_rng(seed).integers(0, vocab_size, length).tolist()


def machine_info() -> str:
    """One line naming the machine a benchmark ran on."""
    import os
    import platform

    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()}-core {cpu}, {platform.system()} {platform.release()}, Python {platform.python_version()}"
