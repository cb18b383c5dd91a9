"""A data-parallel learner over torch.distributed: every rank holds the model, each trains on a share of the rows.

``DataParallel`` is the learner's view of its process group (started by ``torchrun`` or any
launcher that sets ``torch.distributed`` up). Every rank holds the same whole batch (the rows are
plain data) and the same weights; in each mini-batch:

1. the denominators of the loss (tokens for ``token-mean``, live sequences and the length constant
   for the ``seq-mean`` modes) are computed from the **whole** mini-batch, identically on every
   rank, so no rank's share is normalised by its own count;
2. each rank runs forward and backward on its share of the rows (``shard``: by decreasing length,
   each row to the rank with the fewest tokens so far, so shares are balanced but uneven);
3. the gradients of what the optimiser steps on (float32 masters included) are summed across
   ranks (``all_reduce``, in buckets), as are the metric sums;

so the summed gradient is the single-process gradient of the whole mini-batch, whatever the
token counts per rank (``tests/test_data_parallel.py`` checks it on 2 processes with gloo), and
every rank takes the same optimiser step. Recomputed old log-probs are computed on the shares and
summed into the whole batch on every rank. A model that fits one device is replicated (DDP's
arrangement, without its module wrapper, which ctxrl's own forward pass would bypass); sharding
the weights is ``ctxrl.distributed.sharded.ShardedRanks`` (FSDP2), which the learner takes in this one's place.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

BUCKET_BYTES = 64 << 20
CONTROL_TIMEOUT_S = 7 * 24 * 3600
"""How long a follower rank waits for the leader's next message (the warm start, rollouts and evaluations run in
between). Long on purpose: if the leader dies, torchrun ends the other ranks anyway."""
CLOSE_TIMEOUT_S = 300
"""How long ``close`` waits for the other ranks before it gives up on a clean teardown."""


class DataParallel:
    """This process's rank among ``world`` learner ranks, and the collectives the learner needs."""

    sharded = False
    """Whether the model's parameters are sharded over the ranks (``ctxrl.distributed.sharded.ShardedRanks``)."""

    def __init__(self, group=None, *, owns_group: bool = False) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DataParallel needs torch.distributed initialised (torchrun, or "
                               "torch.distributed.init_process_group) before the learner is built")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._control = None
        self.owns_group = owns_group
        """Whether this object's maker started the process group (``from_environment``): ``close`` then destroys it."""

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def control(self):
        """A gloo group for plain-data messages (rows, commands): on the CPU, with a long timeout, whatever the
        tensors' backend. Created on first use, which every rank must reach together."""
        if self._control is None:
            self._control = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))
        return self._control

    def broadcast_object(self, obj=None):
        """The leader's ``obj`` on every rank (the leader passes it, the others pass nothing)."""
        box = [obj if self.leader else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Give every rank the leader's parameters and buffers (after a warm start only the leader ran)."""
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0, group=self.group)

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    @classmethod
    def from_environment(cls, device: torch.device | str | None = None) -> DataParallel | None:
        """Join the group ``torchrun`` describes (``WORLD_SIZE`` > 1): NCCL on CUDA, gloo elsewhere; None alone."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        if not dist.is_initialized():
            cuda = device is not None and torch.device(device).type == "cuda"
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # "cuda" is this rank's own GPU
            dist.init_process_group("nccl" if cuda else "gloo")
            return cls(owns_group=True)
        return cls()

    def close(self) -> None:
        """Leave cleanly: wait until every rank is here, then destroy the process group if this object started it.

        A process that exits with its gloo group still up is now and then aborted at interpreter exit (SIGABRT,
        about 1 run in 7 on two CPU ranks, after a run that succeeded: torchrun then reports a failure); one rank
        tearing the group down while another still uses it does the same. If the other ranks do not arrive within
        ``CLOSE_TIMEOUT_S`` (one of them failed), nothing is destroyed and the error is left to the launcher."""
        if not dist.is_initialized():
            return
        try:
            dist.monitored_barrier(group=self.control, timeout=timedelta(seconds=CLOSE_TIMEOUT_S))
        except RuntimeError as exc:
            log.warning("rank %d: the other ranks did not reach the end (%s); leaving the process group as it is",
                        self.rank, exc)
            return
        if self.owns_group:
            dist.destroy_process_group()  # the default group and every group made from it
            self._control = None

    def shard(self, lengths: list[int]) -> list[int]:
        """The rows (indices into ``lengths``) this rank trains on: longest first, each to the least-loaded rank."""
        loads = [0] * self.world
        mine = []
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            rank = min(range(self.world), key=lambda r: (loads[r], r))
            loads[rank] += lengths[i]
            if rank == self.rank:
                mine.append(i)
        return sorted(mine)

    def reduce_gradients(self, params: list[torch.Tensor]) -> None:
        """Make every rank's ``.grad`` of ``params`` the whole mini-batch's: summed across ranks here."""
        self.sum_gradients(params)

    def clip_gradients(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the (already summed, equal) gradients of ``params`` to ``max_norm``; returns their norm before."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def most(self, count: int) -> int:
        """``count``: a replicated model's forward passes need not match across ranks (no collective)."""
        return count

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` across ranks, in place; returns it."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum the ``.grad`` of ``params`` across ranks, in buckets. A parameter with a gradient on some rank gets
        the sum (zeros where a rank had none); one with a gradient on no rank keeps ``None``, as it would in one
        process (AdamW then leaves it alone: no weight decay, no moment update)."""
        if not params:
            return
        device = params[0].device
        has = self.sum_(torch.tensor([float(p.grad is not None) for p in params], device=device)).tolist()
        grads = []
        for p, anywhere in zip(params, has):
            if not anywhere:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        bucket: list[torch.Tensor] = []
        size = 0
        for g in grads:
            if bucket and (g.dtype != bucket[0].dtype or g.device != bucket[0].device
                           or size + g.numel() * g.element_size() > BUCKET_BYTES):
                self._sum_bucket(bucket)
                bucket, size = [], 0
            bucket.append(g)
            size += g.numel() * g.element_size()
        if bucket:
            self._sum_bucket(bucket)

    def _sum_bucket(self, bucket: list[torch.Tensor]) -> None:
        if len(bucket) == 1:
            self.sum_(bucket[0])
            return
        flat = self.sum_(torch.cat([g.reshape(-1) for g in bucket]))
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def sum_figures(self, sums: dict, device) -> dict:
        """Every number of ``sums`` (floats or 0-d tensors) summed across ranks, in one collective."""
        keys = sorted(sums)
        if not keys:
            return sums
        values = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64, device=device).detach().reshape(())
                              for k in keys])
        return dict(zip(keys, self.sum_(values).tolist()))
