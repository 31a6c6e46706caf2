"""A weight keeper's state made the same on every data-parallel replica.

``DistributedDataParallel`` broadcasts the 16-bit weights of its group's first rank when it wraps the model; what a
keeper holds beside them (FP32 masters built from each rank's own FP32 initialisation, Kahan compensation, the seed
of stochastic rounding drawn from each process's torch seed) is not the model's, so it is broadcast from the same
rank here. Setup only: one collective per tensor and one host read per seed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

_U64 = 2**64


def broadcast_(tensors: Iterable[torch.Tensor], group: ProcessGroup | None) -> None:
    """Overwrite each of ``tensors`` (in place, in the same order on every rank) with the first rank of ``group``'s."""
    with torch.no_grad():
        for tensor in tensors:
            buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
            dist.broadcast(buffer, group=group, group_src=0)
            if buffer is not tensor:
                tensor.copy_(buffer)


def agree_seed(seed: int, group: ProcessGroup | None, device: torch.device | str) -> int:
    """The seed of the first rank of ``group`` (an int in ``[0, 2**64)``; ``device``: where the backend
    communicates, e.g. the model's). One host read."""
    value = torch.tensor([seed - _U64 if seed >= 2**63 else seed], dtype=torch.int64, device=device)
    dist.broadcast(value, group=group, group_src=0)
    return int(value.item()) % _U64


def default_replicas(params: Iterable[torch.Tensor]) -> ProcessGroup | None:
    """The default process group when this process is one of several replicas of a model whose ``params`` are whole
    tensors (not DTensor shards, which differ by rank), else None."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in params):
        return None
    return dist.group.WORLD
