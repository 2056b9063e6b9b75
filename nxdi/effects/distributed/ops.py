"""Collectives as torch custom ops over torch.distributed, for programs that run on CPU ranks.
Effects: registers custom ops with torch (once per process), communicates through the default
process group.

`collectives(world)` is the `nxdi.core.programs.collectives.Collectives` value a rank's program is
traced and run with. Each collective is an `nxdi::` custom op, so `torch.export` records it as one
opaque node (its fake implementation gives the output shape; tracing needs no process group), a
saved program carries it, and a rank process that loaded the program runs it with gloo. `register()`
must run before a program using them is traced or loaded; it does nothing the second time.

In rank processes a driver started, tensors that fit go through the host's shared memory
(`use_host_world`, see `host_world`) and only larger ones through gloo. Every call is counted and
timed per process (`collective_stats`), for `nxdi bench generate`: the time includes waiting for
the slowest rank, which is what a step pays.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

from nxdi.core.programs.collectives import Collectives
from nxdi.effects.distributed.host_world import HostWorld

NAMESPACE = "nxdi"
_registered: list[bool] = []
_stats: dict[str, list[float]] = {}
"""op name -> [calls, seconds] in this process since the last reset."""
_host: list[HostWorld] = []
"""The host world of this rank process, when it has one."""


def use_host_world(world: HostWorld) -> None:
    """Send the collectives that fit through `world` from now on (a rank process, once)."""
    _host[:] = [world]


def _on_host(x: Tensor) -> HostWorld | None:
    return _host[0] if _host and _host[0].fits(x) else None


@contextmanager
def _timed(name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    entry = _stats.setdefault(name, [0, 0.0])
    entry[0] += 1
    entry[1] += time.perf_counter() - start


def collective_stats(*, reset: bool = False) -> dict[str, tuple[int, float]]:
    """Calls and seconds of each collective this process ran (since the last reset)."""
    out = {name: (int(calls), seconds) for name, (calls, seconds) in _stats.items()}
    if reset:
        _stats.clear()
    return out


def _chunk_shape(x: Tensor, dim: int, world: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] //= world
    return shape


def register() -> None:
    """Define the `nxdi::` collective ops in this process (idempotent)."""
    if _registered:
        return
    lib = NAMESPACE

    @torch.library.custom_op(f"{lib}::all_reduce", mutates_args=())
    def all_reduce(x: Tensor) -> Tensor:
        with _timed("all_reduce"):
            host = _on_host(x)
            if host is not None:
                return host.all_reduce(x)
            out = x.clone()
            dist.all_reduce(out)
        return out

    @all_reduce.register_fake
    def _(x: Tensor) -> Tensor:
        return torch.empty_like(x)

    @torch.library.custom_op(f"{lib}::all_gather", mutates_args=())
    def all_gather(x: Tensor, dim: int, world: int) -> Tensor:
        with _timed("all_gather"):
            host = _on_host(x)
            if host is not None:
                return host.all_gather(x, dim)
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim)

    @all_gather.register_fake
    def _(x: Tensor, dim: int, world: int) -> Tensor:
        shape = list(x.shape)
        shape[dim] *= world
        return x.new_empty(shape)

    @torch.library.custom_op(f"{lib}::reduce_scatter", mutates_args=())
    def reduce_scatter(x: Tensor, dim: int, world: int) -> Tensor:
        with _timed("reduce_scatter"):
            host = _on_host(x)
            if host is not None:
                return host.reduce_scatter(x, dim)
            moved = x.movedim(dim, 0).contiguous()  # gloo scatters along dim 0
            out = moved.new_empty([moved.shape[0] // world, *moved.shape[1:]])
            dist.reduce_scatter_tensor(out, moved)
        return out.movedim(0, dim).contiguous()

    @reduce_scatter.register_fake
    def _(x: Tensor, dim: int, world: int) -> Tensor:
        return x.new_empty(_chunk_shape(x, dim, world))

    @torch.library.custom_op(f"{lib}::scatter", mutates_args=())
    def scatter(x: Tensor, dim: int, world: int) -> Tensor:
        return x.chunk(world, dim)[dist.get_rank()].clone()  # a custom op may not return a view of its input

    @scatter.register_fake
    def _(x: Tensor, dim: int, world: int) -> Tensor:
        return x.new_empty(_chunk_shape(x, dim, world))

    @torch.library.custom_op(f"{lib}::rank", mutates_args=())
    def rank(like: Tensor) -> Tensor:
        return torch.tensor(dist.get_rank(), dtype=torch.int64)

    @rank.register_fake
    def _(like: Tensor) -> Tensor:
        return torch.empty((), dtype=torch.int64)

    _registered.append(True)


def collectives(world: int) -> Collectives:
    """The collectives of a rank among `world` ranks of the default process group (see `register`)."""
    register()
    ops = getattr(torch.ops, NAMESPACE)
    anchor = torch.zeros(())  # an argument for `rank`: a custom op without tensor inputs cannot be traced

    return Collectives(
        world=world,
        all_reduce=ops.all_reduce,
        all_gather=lambda x, dim: ops.all_gather(x, dim % x.dim(), world),
        reduce_scatter=lambda x, dim: ops.reduce_scatter(x, dim % x.dim(), world),
        scatter=lambda x, dim: ops.scatter(x, dim % x.dim(), world),
        rank=lambda: ops.rank(anchor),
    )
