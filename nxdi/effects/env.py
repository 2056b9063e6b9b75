"""Environment variables nxdi honours. Effects: reads os.environ (the only module that does).

`read_env()` returns a frozen `Env`; everything else takes the fields it needs as arguments, so
configuration stays a pure function of its inputs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs

from nxdi.core.platform import Platform


@attrs.frozen(kw_only=True)
class Env:
    """The environment as nxdi sees it."""

    logical_nc_config: int | None = None
    """NEURON_LOGICAL_NC_CONFIG, which overrides the logical_nc_config attribute."""
    platform_target: Platform | None = None
    """NEURON_PLATFORM_TARGET_OVERRIDE (trn1, trn2, inf2)."""
    rt_visible_cores: str | None = None
    """NEURON_RT_VISIBLE_CORES, for the Neuron runtime."""
    compile_cache_dir: str | None = None
    """NXDI_COMPILE_CACHE: where compiled programs are cached across model folders."""
    num_threads: int | None = None
    """NXDI_NUM_THREADS: torch intra-op threads for the CPU backend."""
    problems: tuple[str, ...] = ()
    """Variables that were set but could not be understood (the shell warns)."""


def _int(environ: Mapping[str, str], name: str, problems: list[str]) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        problems.append(f"{name}={raw!r} is not an integer; ignored")
        return None


def read_env(environ: Mapping[str, str] | None = None) -> Env:
    """Read the variables nxdi honours from `environ` (default: the process environment)."""
    env = os.environ if environ is None else environ
    problems: list[str] = []
    target_raw = env.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    target = None
    if target_raw:
        try:
            target = Platform(target_raw.strip().lower())
        except ValueError:
            problems.append(f"NEURON_PLATFORM_TARGET_OVERRIDE={target_raw!r} is not one of trn1, trn2, inf2; ignored")
    return Env(
        logical_nc_config=_int(env, "NEURON_LOGICAL_NC_CONFIG", problems),
        platform_target=target,
        rt_visible_cores=env.get("NEURON_RT_VISIBLE_CORES"),
        compile_cache_dir=env.get("NXDI_COMPILE_CACHE"),
        num_threads=_int(env, "NXDI_NUM_THREADS", problems),
        problems=tuple(problems),
    )
