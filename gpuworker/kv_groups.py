"""KV cache groups of a hybrid model (docs/blockmgr.md, "Sliding-window layers").

The layers are split into groups of equal size ``g``, each of one kind (full
attention, or sliding with window W): ``g`` is the gcd of the kinds' layer
counts (Gemma 3 270M: 3 full and 15 sliding layers give one full group and
five sliding groups of 3). The pool is ``g`` K/V tensor pairs; layer ``i``
of every group uses pair ``i``, so one block id space serves all groups and
a block belongs to one group at a time. No torch here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int, ...]  # per group: 0 (full attention) or its sliding window
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its tensor pair (its index inside the group)
    group_size: int  # layers per group

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def kv_groups(layer_windows: list[int | None], block_size: int, max_model_len: int,
              disabled: bool = False) -> KVGroups | None:
    """The groups for layers with these windows (None: full attention), or
    None for today's one table per sequence: a model without a sliding layer,
    windows no shorter than the context (nothing would ever be released), or
    ``disabled`` (--disable-hybrid-kv-cache-manager)."""
    sliding = [w for w in layer_windows if w is not None]
    if disabled or not sliding or min(sliding) + block_size >= max_model_len:
        return None
    kinds: dict[int, list[int]] = {}
    for i, w in enumerate(layer_windows):
        kinds.setdefault(0 if w is None else int(w), []).append(i)
    g = math.gcd(*(len(v) for v in kinds.values()))
    windows: list[int] = []
    layer_group = [0] * len(layer_windows)
    layer_slot = [0] * len(layer_windows)
    for w in sorted(kinds):  # the full group(s) first
        layers = kinds[w]
        for j in range(0, len(layers), g):
            for slot, i in enumerate(layers[j:j + g]):
                layer_group[i], layer_slot[i] = len(windows), slot
            windows.append(w)
    return KVGroups(tuple(windows), tuple(layer_group), tuple(layer_slot), g)
