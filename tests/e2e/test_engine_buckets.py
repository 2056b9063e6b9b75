"""Bucketing: on and off give the same tokens, every compiled bucket runs, and each call takes the
smallest bucket that fits (REFERENCE §3 with the §15 rule `required <= bucket`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from nxdi.core.planning.program_key import ProgramKey
from tests.support.engine_fixtures import PROMPTS, nxdi_generate, program_calls, runtime_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTEXT_BUCKETS = (4, 8, 16)
TOKEN_BUCKETS = (16, 32, 64)
BUCKETED = dict(
    batch_size=4,
    max_context_length=16,
    enable_bucketing=True,
    context_encoding_buckets=list(CONTEXT_BUCKETS),
    token_generation_buckets=list(TOKEN_BUCKETS),
)
UNBUCKETED = dict(batch_size=4, max_context_length=16)
NEW = 40
"""A 14-token prompt plus 40 new tokens reaches position 52: token buckets 16, 32 and 64 all run."""


def _smallest(table: tuple[int, ...], n: int) -> int:
    return next(b for b in table if n <= b)


@pytest.mark.parametrize("variant", ["llama", "mistral"])
def test_bucketing_on_and_off_give_the_same_tokens_and_every_bucket_runs(
    variant: str, loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    bucketed, plain = loaded_model(variant, **BUCKETED), loaded_model(variant, **UNBUCKETED)
    assert set(runtime_of(bucketed).programs) == {
        *(ProgramKey.context(b, 4) for b in CONTEXT_BUCKETS),
        *(ProgramKey.token(b, 4) for b in TOKEN_BUCKETS),
    }
    assert set(runtime_of(plain).programs) == {ProgramKey.context(16, 4), ProgramKey.token(64, 4)}
    runs = [[(3, 4, 5)], [PROMPTS[0][:8]], [PROMPTS[2]], list(PROMPTS)]  # lengths 3, 8 (exact fit), 14, batch
    seen: set[ProgramKey] = set()
    for prompts in runs:
        with program_calls(bucketed) as calls:
            on = nxdi_generate(bucketed, prompts, max_new_tokens=NEW)
        with program_calls(plain) as plain_calls:
            off = nxdi_generate(plain, prompts, max_new_tokens=NEW)
        assert torch.equal(on, off), prompts
        assert set(plain_calls) == {ProgramKey.context(16, 4), ProgramKey.token(64, 4)}
        # the exact buckets, call by call: the prompt's, then one per new token but the last
        longest = max(len(p) for p in prompts)
        expected = [ProgramKey.context(_smallest(CONTEXT_BUCKETS, longest), 4)]
        expected += [ProgramKey.token(_smallest(TOKEN_BUCKETS, longest + k + 1), 4) for k in range(NEW - 1)]
        assert calls == expected
        seen |= set(expected)
    assert seen == set(runtime_of(bucketed).programs), "every compiled bucket ran"
    assert torch.equal(on, hf_greedy(variant, PROMPTS, NEW))


def test_automatic_buckets_cover_long_prompts(
    loaded_model: Callable[..., Any], hf_greedy: Callable[..., torch.Tensor]
) -> None:
    """No explicit tables: powers of two from 128, then the maximum; a 130-token prompt takes 256."""
    model = loaded_model("llama", batch_size=1, seq_len=256, enable_bucketing=True)
    assert set(runtime_of(model).programs) == {
        *(ProgramKey.context(b, 1) for b in (128, 256)),
        *(ProgramKey.token(b, 1) for b in (128, 256)),
    }
    prompt = [3 + (i * 7) % 150 for i in range(130)]
    with program_calls(model) as calls:
        ours = nxdi_generate(model, [prompt], max_new_tokens=4)
    assert calls == [ProgramKey.context(256, 1)] + [ProgramKey.token(256, 1)] * 3
    assert torch.equal(ours, hf_greedy("llama", [prompt], 4))
    with program_calls(model) as calls:
        nxdi_generate(model, [prompt[:128]], max_new_tokens=3)  # exactly 128: the 128 bucket, not the next
    assert calls == [ProgramKey.context(128, 1), ProgramKey.token(256, 1), ProgramKey.token(256, 1)]
