"""The compiled int8 kernels for ``quant.py`` (``quant_cpu.cpp``); not built yet: the torch path runs."""
from __future__ import annotations

import torch


def repack(w) -> torch.Tensor | None:  # noqa: ANN001 - QuantWeight (quant.py imports this module)
    return None


def linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor | None:  # noqa: ANN001
    return None
