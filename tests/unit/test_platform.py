"""The Neuron platform table and logical-NC resolution."""

from __future__ import annotations

import pytest

from nxdi.core.platform import GIB, INSTANCES, PLATFORMS, Platform, platform_of_instance, resolve_lnc


def test_every_platform_has_a_spec_for_itself_and_its_default_lnc() -> None:
    assert set(PLATFORMS) == set(Platform)
    for platform, spec in PLATFORMS.items():
        assert spec.platform is platform
        assert spec.tp_degrees(spec.default_lnc), f"{platform} has no TP degrees at its default LNC"
        assert all(list(d) == sorted(set(d)) for d in spec.valid_tp_degrees.values())


@pytest.mark.parametrize(
    ("platform", "lnc", "gib"),
    [
        (Platform.TRN1, 1, 16),
        (Platform.INF2, 1, 16),
        (Platform.TRN2, 2, 24),
        (Platform.TRN2, 1, 12),
        (Platform.TRN3, 2, 36),  # 144 GiB over a Trainium3 device's 8 cores, paired
    ],
)
def test_hbm_per_logical_core(platform: Platform, lnc: int, gib: int) -> None:
    assert PLATFORMS[platform].hbm_per_core_bytes(lnc) == gib * GIB


def test_documented_tp_degrees() -> None:
    assert PLATFORMS[Platform.TRN1].tp_degrees(1) == (1, 2, 8, 16, 32)
    assert PLATFORMS[Platform.INF2].tp_degrees(1) == (1, 2, 4, 8, 24)
    assert PLATFORMS[Platform.TRN2].tp_degrees(2) == (1, 2, 4, 8, 16, 32, 64)
    assert PLATFORMS[Platform.TRN1].tp_degrees(2) == ()  # trn1 has no LNC=2


def test_trn3_pairs_cores_by_default_like_trn2() -> None:
    assert PLATFORMS[Platform.TRN3].default_lnc == 2 and PLATFORMS[Platform.TRN2].default_lnc == 2
    assert resolve_lnc(env=None, requested=None, platform=Platform.TRN3) == (2, ())


def test_the_largest_tp_degree_fills_the_largest_instance() -> None:
    for platform, spec in PLATFORMS.items():
        known = [i for i in INSTANCES.values() if i.platform is platform]
        if not known:
            continue  # trn3: no instance types in the table (only the platform's per-core facts)
        for lnc in spec.valid_tp_degrees:
            largest = max(i.logical_cores(lnc) for i in known)
            assert max(spec.tp_degrees(lnc)) == largest, (platform, lnc)


@pytest.mark.parametrize(
    ("name", "total_gib"),
    [
        ("trn1.2xlarge", 32),
        ("trn1.32xlarge", 512),
        ("trn2.48xlarge", 1536),
        ("inf2.xlarge", 32),
        ("inf2.48xlarge", 384),
    ],
)
def test_instance_device_memory(name: str, total_gib: int) -> None:
    instance = INSTANCES[name]
    spec = PLATFORMS[instance.platform]
    lnc = spec.default_lnc
    assert instance.name == name
    assert instance.logical_cores(lnc) * spec.hbm_per_core_bytes(lnc) == total_gib * GIB


@pytest.mark.parametrize(
    ("name", "platform"),
    [
        ("trn1.32xlarge", Platform.TRN1),
        ("trn1n.32xlarge", Platform.TRN1),
        ("trn1.8xlarge", Platform.TRN1),  # unknown size, known family
        ("trn2u.48xlarge", Platform.TRN2),
        ("inf2.24xlarge", Platform.INF2),
        ("p4d.24xlarge", None),
        ("", None),
    ],
)
def test_platform_of_instance(name: str, platform: Platform | None) -> None:
    assert platform_of_instance(name) is platform


def test_resolve_lnc_precedence_env_then_request_then_platform() -> None:
    assert resolve_lnc(env=None, requested=None, platform=Platform.TRN2) == (2, ())
    assert resolve_lnc(env=None, requested=None, platform=Platform.TRN1) == (1, ())
    assert resolve_lnc(env=None, requested=1, platform=Platform.TRN2) == (1, ())
    assert resolve_lnc(env=1, requested=None, platform=Platform.TRN2) == (1, ())
    assert resolve_lnc(env=2, requested=2, platform=Platform.TRN1) == (2, ())


def test_resolve_lnc_notes_when_env_overrides_a_request() -> None:
    value, notes = resolve_lnc(env=1, requested=2, platform=Platform.TRN2)
    assert value == 1
    assert notes == ("NEURON_LOGICAL_NC_CONFIG=1 overrides logical_nc_config=2",)
