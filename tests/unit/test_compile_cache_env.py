"""Where the persistent compile cache lives (`env.compile_cache`): on by default, as the Neuron
persistent cache is, moved or turned off by nxdi's own variable or the Neuron ones."""

from __future__ import annotations

import os

import pytest

from nxdi.effects import env


def _cache(**variables: str) -> tuple[str | None, list[str]]:
    problems: list[str] = []
    return env.compile_cache(variables, problems), problems


def test_it_is_on_by_default_in_the_user_cache_folder() -> None:
    assert _cache(XDG_CACHE_HOME="/x") == ("/x/nxdi/compile-cache", [])
    where, _ = _cache()
    assert where == os.path.join(os.path.expanduser("~"), ".cache", "nxdi", "compile-cache")


@pytest.mark.parametrize("off", ["0", "off", "OFF", "false", "no", "none", ""])
def test_nxdi_compile_cache_moves_or_turns_it_off(off: str) -> None:
    assert _cache(NXDI_COMPILE_CACHE="/somewhere") == ("/somewhere", [])
    assert _cache(NXDI_COMPILE_CACHE=off, NEURON_CC_FLAGS="--cache_dir=/ignored") == (None, [])


def test_the_neuron_variables_are_honoured() -> None:
    assert _cache(NEURON_CC_FLAGS="-O1 --cache_dir=/neuron/cache") == ("/neuron/cache", [])
    assert _cache(NEURON_CC_FLAGS="--cache_dir /spaced --model-type=transformer") == ("/spaced", [])
    assert _cache(NEURON_CC_FLAGS="--no_cache", XDG_CACHE_HOME="/x") == (None, [])
    assert _cache(NEURON_COMPILE_CACHE_URL="/local/cache") == ("/local/cache", [])
    assert _cache(NEURON_COMPILE_CACHE_URL="file:///local/cache") == ("/local/cache", [])


def test_a_remote_cache_url_is_reported_and_the_default_used() -> None:
    where, problems = _cache(NEURON_COMPILE_CACHE_URL="s3://bucket/cache", XDG_CACHE_HOME="/x")
    assert where == "/x/nxdi/compile-cache"
    assert len(problems) == 1 and "s3://bucket/cache" in problems[0] and "NXDI_COMPILE_CACHE" in problems[0]


def test_read_env_reads_it() -> None:
    assert env.read_env({"NXDI_COMPILE_CACHE": "/c"}).compile_cache_dir == "/c"
    assert env.read_env({"XDG_CACHE_HOME": "/y"}).compile_cache_dir == "/y/nxdi/compile-cache"
