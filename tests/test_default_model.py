"""The embedded default model: converted once, atomically, and it still answers."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from pagedserve.common import default_model


def test_explicit_folder_is_returned_and_missing_one_rejected(tmp_path: Path) -> None:
    assert default_model.resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="not found"):
        default_model.resolve_model(str(tmp_path / "nope"))


def test_gguf_is_found_without_importing_the_plugin() -> None:
    path = default_model.gguf_path()
    assert path.name == default_model.GGUF_FILE and path.stat().st_size > 50_000_000


def test_concurrent_resolvers_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two callers racing on a cold cache: one converts, the other waits on the
    lock and then reuses the folder; nobody sees a partial folder."""
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    calls: list[Path] = []

    def fake_convert(src: Path, target: Path) -> None:
        calls.append(target)
        time.sleep(0.3)  # long enough for the other thread to reach the lock
        tmp = target.parent / "building"
        tmp.mkdir()
        for name in ("config.json", "tokenizer.json", "model.safetensors"):
            (tmp / name).write_text("{}")
        tmp.rename(target)

    monkeypatch.setattr(default_model, "_convert", fake_convert)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(default_model.resolve_model(None))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [str(tmp_path / default_model.CONVERTED_NAME)] * 2


def test_converted_model_answers_paris() -> None:
    """Cold cache: ~25 s to convert on 2 CPU cores; warm: ~5 s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = default_model.resolve_model(None)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert tok.eos_token == "<|im_end|>" and model.config.eos_token_id == tok.eos_token_id
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer
