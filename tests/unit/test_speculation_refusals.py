"""Speculation with batch buckets is refused as NxDI refuses it: every speculation setting that is on
is named in one problem on `token_generation_batches`, beside the config's other problems."""

from __future__ import annotations

import pytest

from nxdi.shell.config import NeuronConfig
from nxdi.shell.exceptions import IncompatibleConfigError


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"speculation_length": 4}, ["speculation_length"]),
        (
            {"speculation_length": 4, "enable_fused_speculation": True, "on_device_sampling_config": {"top_k": 1}},
            ["speculation_length", "enable_fused_speculation"],
        ),
        (
            {
                "is_medusa": True,
                "medusa_speculation_length": 4,
                "num_medusa_heads": 2,
                "medusa_tree": [[0], [1], [0, 0]],
            },
            ["is_medusa"],
        ),
    ],
)
def test_speculation_with_batch_buckets_is_refused_naming_each_setting(
    settings: dict[str, object], named: list[str]
) -> None:
    with pytest.raises(IncompatibleConfigError) as raised:
        NeuronConfig(batch_size=4, token_generation_batches=[2, 4], max_context_length=-1, **settings)
    text = str(raised.value)
    assert "token_generation_batches=[2, 4]: (batch bucketing) is not supported with " + ", ".join(named) in text
    assert "max_context_length=-1" in text  # every problem at once
