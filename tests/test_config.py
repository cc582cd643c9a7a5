"""The frozen EngineConfig: flags round-trip to child processes, bad values are refused."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedserve.common.config import EngineConfig, add_engine_args, config_from_args, engine_argv, parse_size


def parse(argv: list[str]) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return config_from_args(p.parse_args(argv))


@pytest.mark.parametrize("argv", [[], ["--kv-cache-memory", "64MiB", "--no-prefix-caching", "--enforce-eager",
                                        "--no-async-scheduling"], ["--async-scheduling"],
                                  ["--async-scheduling", "auto", "--device", "cuda"],
                                  ["--num-gpu-blocks", "100", "--block-size", "32", "-tp", "2", "--worker", "sim",
                                   "--preemption-mode", "swap", "--swap-space", "0.5", "--dtype", "float16"]])
def test_engine_argv_rebuilds_the_same_config(argv: list[str]) -> None:
    cfg = parse(argv)
    assert parse(engine_argv(cfg)) == cfg


def test_config_is_frozen_and_validated() -> None:
    cfg = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 32  # type: ignore[misc]
    for bad in ({"block_size": 12}, {"device": "tpu"}, {"preemption_mode": "x"}, {"max_num_seqs": 0},
                {"tensor_parallel_size": 0}, {"worker": "other"}, {"num_gpu_blocks": 1}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)  # type: ignore[arg-type]
    assert parse_size("512MiB") == 512 << 20 and parse_size("2G") == 2 << 30 and parse_size("1000") == 1000


def test_enforce_eager_turns_cuda_graphs_off() -> None:
    from pagedserve.gpuworker.model_runner import ModelRunner

    assert ModelRunner(EngineConfig(enforce_eager=True), cuda_graphs=True).want_graphs is False


def test_the_worker_address_variable_does_not_feed_the_worker_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """compose sets PAGEDSERVE_WORKER to the worker's address; --worker reads PAGEDSERVE_WORKER_KIND."""
    monkeypatch.setenv("PAGEDSERVE_WORKER", "tcp://gpuworker:5558")
    assert parse([]).worker == "model"
    monkeypatch.setenv("PAGEDSERVE_WORKER_KIND", "sim")
    assert parse([]).worker == "sim"


def test_context_limit_and_layer_windows_come_from_the_config() -> None:
    from types import SimpleNamespace

    from pagedserve.gpuworker.layers import layer_sliding_window
    from pagedserve.gpuworker.loader import DEFAULT_MAX_POSITIONS, context_limit

    mistral = SimpleNamespace(max_position_embeddings=512, sliding_window=64)
    assert context_limit(mistral) == 512  # the window is masked per layer, not a cap on the context
    assert layer_sliding_window(mistral, 1) == 64
    assert layer_sliding_window(SimpleNamespace(sliding_window=64, use_sliding_window=False), 0) is None  # Qwen2
    gemma = SimpleNamespace(sliding_window=32, layer_types=["sliding_attention", "full_attention"])
    assert [layer_sliding_window(gemma, i) for i in range(2)] == [32, None]
    assert context_limit(SimpleNamespace()) == DEFAULT_MAX_POSITIONS


def test_async_scheduling_auto_is_on_with_cuda_only() -> None:
    # On CPU the planning would take cores from the worker's threads (measured slower, docs/benchmarks.md).
    assert not EngineConfig().use_async_scheduling
    assert EngineConfig(device="cuda").use_async_scheduling and EngineConfig(device="cuda:1").use_async_scheduling
    assert EngineConfig(async_scheduling="on").use_async_scheduling
    assert not EngineConfig(device="cuda", async_scheduling="off").use_async_scheduling
    assert parse(["--async-scheduling"]).async_scheduling == "on"
    assert parse(["--no-async-scheduling"]).async_scheduling == "off"
    with pytest.raises(ValueError):
        EngineConfig(async_scheduling="yes")
