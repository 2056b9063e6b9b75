"""The runtime's static-shape write-back of chosen cache rows (the path a deferring backend, XLA,
takes): padding rows (-1) write nothing, and a row named by several batch rows (a garbage row)
takes one of them, never an index outside the batch."""

from __future__ import annotations

import torch

from nxdi.effects import runtime


def test_blended_rows_write_named_rows_only_and_a_repeated_row_takes_its_last_writer() -> None:
    full = torch.zeros(5, 2, 3, 1)  # [R, K, T, D]: rows 0..3 real, row 4 the garbage row
    part = torch.arange(1, 5, dtype=torch.float32)[:, None, None, None].expand(4, 2, 2, 1)  # batch row j: j + 1
    out = runtime._blend_rows(full[:, :, :2], part, torch.tensor([1, 4, 4, -1]), dim=0)
    assert out[:, 0, 0, 0].tolist() == [0, 1, 0, 0, 3]
    lead = runtime._updated(full[None], part[None], 2, torch.tensor([2, 4, 4, 4]), lead=1)  # [1, R, K, T, D]
    assert lead[0, :, 0, 0, 0].tolist() == [0, 0, 1, 0, 4]
    assert lead[0, :, :, 2].abs().sum() == 0, "positions past the bucket are kept"
