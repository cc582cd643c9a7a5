"""The repository's top-level ``kernels/`` folder is ``pagedserve.kernels``,
never the ``kernels`` package transformers imports (a dependency of
transformers >= 5.25): ``python -m`` in the repository's root puts the root
on sys.path, and importing pagedserve takes it off again."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_python_m_in_the_repository_root_does_not_see_our_kernels_as_kernels() -> None:
    probe = ("import importlib.util, sys\n"
             "before = importlib.util.find_spec('kernels')\n"
             "import pagedserve\n"
             "after = importlib.util.find_spec('kernels')\n"
             "print(before.origin if before else None)\n"
             "print(after.origin if after else None)\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True).stdout.splitlines()
    assert out[0] == str(ROOT / "kernels" / "__init__.py")  # the shadowing this guards against is real here
    assert out[1] != out[0]  # the installed `kernels` package, or none


def test_transformers_builds_a_model_when_run_from_the_repository_root() -> None:
    probe = ("import pagedserve, transformers\n"
             "cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,"
             " num_attention_heads=2, num_key_value_heads=1)\n"
             "print(type(transformers.AutoModelForCausalLM.from_config(cfg)).__name__)\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("LlamaForCausalLM")
