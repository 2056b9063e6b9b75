"""Neuron platform facts: cores, HBM per core, valid tensor-parallel degrees, LNC defaults. Pure.

One table, used by config checks, the memory planner and `nxdi plan`. Figures are per *logical*
NeuronCore at the platform's default logical-NC configuration (LNC), as the Neuron docs state them:
trn2 cores have 24 GB each at LNC=2, trn3 cores 36 GiB at LNC=2 (a Trainium3 device holds eight
NeuronCore-v4 and 144 GiB), trn1/inf2 cores 16 GB. trn2 and trn3 default to LNC=2, the others to 1.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs

GIB = 1 << 30


class Platform(enum.Enum):
    TRN1 = "trn1"
    TRN2 = "trn2"
    TRN3 = "trn3"
    INF2 = "inf2"


@attrs.frozen(kw_only=True)
class PlatformSpec:
    """What one Neuron platform offers, per logical core at a given LNC."""

    platform: Platform
    default_lnc: int
    """Physical cores per logical core unless NEURON_LOGICAL_NC_CONFIG or logical_nc_config says otherwise."""
    hbm_per_physical_core_bytes: int
    valid_tp_degrees: Mapping[int, tuple[int, ...]]
    """Tensor-parallel degrees the Neuron runtime supports, by LNC."""

    def hbm_per_core_bytes(self, lnc: int) -> int:
        """HBM of one logical core at `lnc` physical cores per logical core."""
        return self.hbm_per_physical_core_bytes * lnc

    def tp_degrees(self, lnc: int) -> tuple[int, ...]:
        """Valid TP degrees at `lnc`; empty when this platform does not support that LNC."""
        return self.valid_tp_degrees.get(lnc, ())


PLATFORMS: Mapping[Platform, PlatformSpec] = {
    Platform.TRN1: PlatformSpec(
        platform=Platform.TRN1,
        default_lnc=1,
        hbm_per_physical_core_bytes=16 * GIB,
        valid_tp_degrees={1: (1, 2, 8, 16, 32)},
    ),
    Platform.TRN2: PlatformSpec(
        platform=Platform.TRN2,
        default_lnc=2,
        hbm_per_physical_core_bytes=12 * GIB,
        valid_tp_degrees={2: (1, 2, 4, 8, 16, 32, 64), 1: (1, 2, 4, 8, 16, 32, 64, 128)},
    ),
    # Trainium3 devices, like Trainium2 ones, hold eight cores that pair into logical cores by default;
    # the TP degrees are trn2's (the runtime's power-of-two groups of logical cores).
    Platform.TRN3: PlatformSpec(
        platform=Platform.TRN3,
        default_lnc=2,
        hbm_per_physical_core_bytes=18 * GIB,
        valid_tp_degrees={2: (1, 2, 4, 8, 16, 32, 64), 1: (1, 2, 4, 8, 16, 32, 64, 128)},
    ),
    Platform.INF2: PlatformSpec(
        platform=Platform.INF2,
        default_lnc=1,
        hbm_per_physical_core_bytes=16 * GIB,
        valid_tp_degrees={1: (1, 2, 4, 8, 24)},
    ),
}


@attrs.frozen(kw_only=True)
class InstanceSpec:
    """An EC2 instance type: which platform and how many physical NeuronCores."""

    name: str
    platform: Platform
    physical_cores: int

    def logical_cores(self, lnc: int) -> int:
        return self.physical_cores // lnc


INSTANCES: Mapping[str, InstanceSpec] = {
    i.name: i
    for i in (
        InstanceSpec(name="trn1.2xlarge", platform=Platform.TRN1, physical_cores=2),
        InstanceSpec(name="trn1.32xlarge", platform=Platform.TRN1, physical_cores=32),
        InstanceSpec(name="trn1n.32xlarge", platform=Platform.TRN1, physical_cores=32),
        InstanceSpec(name="trn2.3xlarge", platform=Platform.TRN2, physical_cores=8),
        InstanceSpec(name="trn2.48xlarge", platform=Platform.TRN2, physical_cores=128),
        InstanceSpec(name="trn2u.48xlarge", platform=Platform.TRN2, physical_cores=128),
        InstanceSpec(name="inf2.xlarge", platform=Platform.INF2, physical_cores=2),
        InstanceSpec(name="inf2.8xlarge", platform=Platform.INF2, physical_cores=2),
        InstanceSpec(name="inf2.24xlarge", platform=Platform.INF2, physical_cores=12),
        InstanceSpec(name="inf2.48xlarge", platform=Platform.INF2, physical_cores=24),
    )
}
"""Known instance types by name."""


def platform_of_instance(name: str) -> Platform | None:
    """The platform of an instance type name (`trn1.32xlarge` -> TRN1), or None when unknown."""
    known = INSTANCES.get(name)
    if known is not None:
        return known.platform
    family = name.split(".", 1)[0].rstrip("nu")
    return next((p for p in Platform if p.value == family), None)


def resolve_lnc(*, env: int | None, requested: int | None, platform: Platform) -> tuple[int, tuple[str, ...]]:
    """Logical NC config; precedence env > requested > platform default.

    Returns the value and notes (for the shell to turn into warnings) when env overrides a request.
    """
    notes: tuple[str, ...] = ()
    if env is not None and requested is not None and env != requested:
        notes = (f"NEURON_LOGICAL_NC_CONFIG={env} overrides logical_nc_config={requested}",)
    value = next(v for v in (env, requested, PLATFORMS[platform].default_lnc) if v is not None)
    return value, notes
