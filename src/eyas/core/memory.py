"""Free memory where tensors live: what a stage checks before it copies weights or sizes its buffers."""

from __future__ import annotations

import os

import torch


def free_memory(device: torch.device | str) -> int | None:
    """Bytes free on ``device``: a CUDA device's (``cudaMemGetInfo``), else the host's available memory; None where
    the system does not say."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not on this system: nothing to compare with
        return None
