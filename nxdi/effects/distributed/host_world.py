"""Collectives among the rank processes of one host, through shared memory. Effects: maps a file,
reads and writes pipes.

gloo over loopback TCP costs 0.5-1.2 ms per collective on a small host, whatever the size, and a
decode step makes a few per layer. The rank processes a driver starts all live on its host, so
they can exchange tensors through one memory-mapped file instead (tmpfs where there is one):

- Every rank owns a slot per buffer; a collective copies the rank's tensor into its slot, waits at
  a barrier, then reads every slot (sums in rank order, so every rank computes bit-identical
  results, or concatenates). Collectives alternate between two buffers, so a rank may only
  overwrite a slot two collectives later, after a barrier every rank passes once done reading it:
  one barrier per collective.
- The barrier is a byte sent on a pipe to every other rank and one read from each: a pipe per
  ordered pair, so tokens of consecutive barriers never mix. A peer that dies closes its pipes and
  the read fails instead of hanging (the driver stops the rest).
- Tensors larger than a slot go through gloo (`fits`), decided from shapes alone, which every rank
  shares, so all ranks always take the same path.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
from torch import Tensor

_ALIGN = 64
BUFFERS = 2


@attrs.frozen(kw_only=True)
class HostWorldSpec:
    """What a rank needs to join a host world: the shared file, the slot size and its pipe ends."""

    path: str
    slot_bytes: int
    reads: tuple[int, ...]
    """Per peer rank (this rank's own entry is -1), the fd this rank reads that peer's tokens from."""
    writes: tuple[int, ...]
    """Per peer rank (own entry -1), the fd this rank writes its tokens to."""

    def to_arg(self) -> str:
        reads, writes = ",".join(map(str, self.reads)), ",".join(map(str, self.writes))
        return f"{self.path}:{self.slot_bytes}:{reads}:{writes}"

    @classmethod
    def from_arg(cls, text: str) -> HostWorldSpec:
        path, slot, reads, writes = text.rsplit(":", 3)
        return cls(
            path=path,
            slot_bytes=int(slot),
            reads=tuple(int(f) for f in reads.split(",")),
            writes=tuple(int(f) for f in writes.split(",")),
        )


def slot_bytes_for(kib: int) -> int:
    """A slot of `kib` KiB, rounded up to the alignment every dtype view needs."""
    return -(-kib * 1024 // _ALIGN) * _ALIGN


class HostPlan:
    """The driver's side: the shared file and the pipes of `world` ranks (close() releases them)."""

    def __init__(self, world: int, slot_bytes: int) -> None:
        self.world, self.slot_bytes = world, slot_bytes
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="nxdi-host-world-", dir=where)
        os.ftruncate(fd, BUFFERS * world * slot_bytes)
        os.close(fd)
        self.pipes = {(a, b): os.pipe() for a in range(world) for b in range(world) if a != b}
        """(sender, receiver) -> (read fd, write fd)."""

    def spec(self, rank: int) -> HostWorldSpec:
        reads = tuple(-1 if p == rank else self.pipes[(p, rank)][0] for p in range(self.world))
        writes = tuple(-1 if p == rank else self.pipes[(rank, p)][1] for p in range(self.world))
        return HostWorldSpec(path=self.path, slot_bytes=self.slot_bytes, reads=reads, writes=writes)

    def fds(self, rank: int) -> tuple[int, ...]:
        """The fds rank `rank` inherits."""
        spec = self.spec(rank)
        return tuple(f for f in (*spec.reads, *spec.writes) if f >= 0)

    def close_pipes(self) -> None:
        """Drop the driver's copies of the pipe ends (the ranks hold theirs), so that a rank whose
        peer dies reads end-of-file instead of waiting."""
        for r, w in self.pipes.values():
            for fd in (r, w):
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.pipes = {}

    def close(self) -> None:
        self.close_pipes()
        Path(self.path).unlink(missing_ok=True)


class HostWorld:
    """One rank's side of the host world."""

    def __init__(self, rank: int, world: int, spec: HostWorldSpec) -> None:
        self.rank, self.world, self.spec = rank, world, spec
        with open(spec.path, "r+b") as f:
            self.map = mmap.mmap(f.fileno(), BUFFERS * world * spec.slot_bytes)
        self.memory = torch.frombuffer(self.map, dtype=torch.uint8)
        self.turn = 0

    def fits(self, x: Tensor) -> bool:
        """Whether a collective of tensors shaped like `x` goes through shared memory."""
        return x.numel() * x.element_size() <= self.spec.slot_bytes

    def _slot(self, buffer: int, rank: int, like: Tensor) -> Tensor:
        start = (buffer * self.world + rank) * self.spec.slot_bytes
        n = like.numel() * like.element_size()
        return self.memory[start : start + n].view(like.dtype).view(like.shape)

    def _exchange(self, x: Tensor) -> list[Tensor]:
        """Publish x and return every rank's (views of the shared slots, valid until the next
        collective but one)."""
        buffer, self.turn = self.turn, (self.turn + 1) % BUFFERS
        self._slot(buffer, self.rank, x).copy_(x)
        self._barrier()
        return [self._slot(buffer, r, x) for r in range(self.world)]

    def _barrier(self) -> None:
        for peer, fd in enumerate(self.spec.writes):
            if peer != self.rank:
                os.write(fd, b"\0")
        for peer, fd in enumerate(self.spec.reads):
            if peer != self.rank and not os.read(fd, 1):
                raise RuntimeError(f"tensor-parallel rank {peer} is gone (its pipe closed)")

    def all_reduce(self, x: Tensor) -> Tensor:
        return _sum(self._exchange(x))

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        return torch.cat(self._exchange(x.contiguous()), dim)

    def reduce_scatter(self, x: Tensor, dim: int) -> Tensor:
        chunks = [part.chunk(self.world, dim)[self.rank] for part in self._exchange(x.contiguous())]
        return _sum(chunks).contiguous()


def _sum(parts: Sequence[Tensor]) -> Tensor:
    out = parts[0].clone()
    for part in parts[1:]:
        out += part
    return out
