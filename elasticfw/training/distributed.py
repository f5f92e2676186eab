"""Data parallelism through ``torch.distributed`` (launched by ``torchrun``).

Under ``torchrun`` (``WORLD_SIZE`` > 1) every process loads the backbone on its own device
(``cuda:LOCAL_RANK``, NCCL; or the CPU with Gloo), takes a contiguous shard of each global
batch, and the router is wrapped in DistributedDataParallel; the Lagrange multipliers and the
logged statistics are all-reduced by hand. Losses are normalised by *global* counts, so one
process and N processes compute the same gradients up to floating-point summation order.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elasticfw.errors import BackendUnavailableError


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device | None = None  # the device this process must use (None: the recipe's)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the processes, in place (a no-op with one process)."""
        if self.enabled:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every process's ``value`` (picklable, produced by this program), in rank order."""
        if not self.enabled:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def broadcast_flag(self, value: bool) -> bool:
        """Rank 0's ``value`` on every process."""
        if not self.enabled:
            return value
        t = torch.tensor([int(value)], device=self.device or "cpu")
        dist.broadcast(t, src=0)
        return bool(t.item())


def init_distributed(device_spec: str) -> DistContext:
    """Join the process group ``torchrun`` describes (or return a single-process context)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_spec != "cpu" and torch.cuda.is_available()
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise BackendUnavailableError(
                f"process {rank} has LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA devices are visible"
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # rank 0 evaluates alone after training while the others wait: allow hours, not NCCL's 10 minutes
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", device_id=device if use_cuda else None,
            timeout=datetime.timedelta(hours=6),
        )
    return DistContext(rank, world, local_rank, device)


def shutdown(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()
