"""Shared steps of the CPU backend's rewrite tests: export a module, rewrite its graph, compare."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx


def rewritten(
    module: torch.nn.Module, args: tuple[torch.Tensor, ...], rewrite: Callable[[fx.GraphModule], int]
) -> tuple[fx.GraphModule, int, Any, Any]:
    """(the rewritten graph module, the rewrite's count, its outputs, the outputs before it) of
    `module` exported on `args` with torch's decompositions, as the CPU backend binds programs."""
    gm = torch.export.export(module, args).run_decompositions({}).module()
    want = gm(*args)
    count = rewrite(gm)
    gm.recompile()
    return gm, count, gm(*args), want


def targets(gm: fx.GraphModule) -> list[object]:
    """The functions the graph calls, in order (repeats kept)."""
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]
