"""Rows of different lengths in padded batches: longest first, each batch padded to its first row's length, so the
padding a forward computes on stays small (`eyas extract`'s batches, the online trainer's verifier forwards)."""

from __future__ import annotations

import numpy as np


def plan_batches(lengths: np.ndarray, batch_tokens: int) -> list[list[int]]:
    """Positions of non-empty rows in batches: longest first, each batch padded to its first row's length and
    holding as many rows as fit in ``batch_tokens`` (a longer row runs alone)."""
    order = sorted((i for i in range(len(lengths)) if lengths[i] > 0), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches
