"""The runtime's static-shape write-back of chosen cache rows (the path a deferring backend, XLA,
takes): padding rows (-1) write nothing, and a row named by several batch rows (a garbage row)
takes one of them, never an index outside the batch; and the host's slices of the cache, made once
per bucket."""

from __future__ import annotations

import dataclasses

import torch

from nxdi.core.planning.program_key import ProgramKey
from nxdi.core.programs.inputs import StepInputs
from nxdi.core.programs.kv_cache import KVCache
from nxdi.core.programs.step import StepOutputs
from nxdi.effects import runtime


def test_blended_rows_write_named_rows_only_and_a_repeated_row_takes_its_last_writer() -> None:
    full = torch.zeros(5, 2, 3, 1)  # [R, K, T, D]: rows 0..3 real, row 4 the garbage row
    part = torch.arange(1, 5, dtype=torch.float32)[:, None, None, None].expand(4, 2, 2, 1)  # batch row j: j + 1
    out = runtime._blend_rows(full[:, :, :2], part, torch.tensor([1, 4, 4, -1]), dim=0)
    assert out[:, 0, 0, 0].tolist() == [0, 1, 0, 0, 3]
    lead = runtime._updated(full[None], part[None], 2, torch.tensor([2, 4, 4, 4]), lead=1)  # [1, R, K, T, D]
    assert lead[0, :, 0, 0, 0].tolist() == [0, 0, 1, 0, 4]
    assert lead[0, :, :, 2].abs().sum() == 0, "positions past the bucket are kept"


def test_a_host_caches_slices_are_made_once_per_bucket_and_follow_a_replaced_cache() -> None:
    """On the host the program gets the same slices of the cache each step of a bucket (written in
    place, they need no write-back); gathered rows are copies and are written back; a cache the
    runtime replaces (a block cache's step) gets slices of its own."""
    seen: list[KVCache] = []

    def program(
        cache: KVCache, x: StepInputs, params: torch.Tensor, draws: torch.Tensor
    ) -> tuple[StepOutputs, KVCache]:
        seen.append(cache)
        for t in (*cache.k, *cache.v):
            t[:, :, int(x.position_ids[0, 0])] += 1.0  # in place, as the CPU backend writes
        return StepOutputs(), cache

    def fresh() -> KVCache:
        return KVCache(k=(torch.zeros(3, 1, 8, 2),), v=(torch.zeros(3, 1, 8, 2),))

    key = ProgramKey.token(4, 2)
    rt = runtime.Runtime(cache=fresh(), programs={key: program})
    x = StepInputs(
        input_ids=torch.zeros(2, 1, dtype=torch.int64),
        position_ids=torch.full((2, 1), 1),
        last_index=torch.zeros(2, dtype=torch.int64),
    )
    for _ in range(2):
        rt.run(key, x, rows=None, params=torch.ones(2, 3))
    assert seen[0] is seen[1] and seen[0].k[0].shape == (2, 1, 4, 2)
    assert rt.cache.k[0][:2, 0, 1].tolist() == [[2.0, 2.0]] * 2 and rt.cache.k[0][2].abs().sum() == 0
    rt.run(
        key,
        dataclasses.replace(x, position_ids=torch.full((2, 1), 2)),
        rows=torch.tensor([2, -1]),
        params=torch.ones(2, 3),
    )
    assert rt.cache.k[0][2, 0, 2].tolist() == [1.0, 1.0], "a gathered row's in-place write comes back"
    assert rt.cache.k[0][:2, 0, 2].abs().sum() == 0, "the padding row (-1) writes nothing"
    rt.cache = fresh()
    rt.run(key, x, rows=None, params=torch.ones(2, 3))
    assert seen[-1].k[0].data_ptr() == rt.cache.k[0].data_ptr() and rt.cache.k[0][0, 0, 1].tolist() == [1.0, 1.0]
