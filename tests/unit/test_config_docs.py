"""Every NeuronConfig attribute is declared once with its documentation, and the reference users
read (`nxdi config --list`, the flags' help, docs/neuron-config.md) is derived from it."""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs
import pytest

from nxdi.core.config.fields import OnCpu, infos, sub_spec_fields
from nxdi.core.config.neuron_spec import NeuronSpec
from nxdi.core.config.sub_specs import MoESpec
from nxdi.shell.cli import reference
from nxdi.shell.cli.flags import add_neuron_config_flags
from nxdi.shell.cli.main import main

DOCS = Path(__file__).resolve().parents[2] / "docs" / "neuron-config.md"
SPEC_CLASSES = (NeuronSpec, MoESpec, *sub_spec_fields(NeuronSpec).values(), *sub_spec_fields(MoESpec).values())


@pytest.mark.parametrize("cls", SPEC_CLASSES, ids=lambda c: c.__name__)
def test_every_field_is_documented_in_one_line(cls: type) -> None:
    for name, info in infos(cls).items():
        assert info.doc and "\n" not in info.doc and info.doc.endswith("."), f"{cls.__name__}.{name}: {info.doc!r}"
        assert len(info.doc) <= 160, f"{cls.__name__}.{name}: keep the description to one line"
        if info.cpu is OnCpu.NO:
            assert info.cpu_note, f"{cls.__name__}.{name} has no effect on the CPU: say why"


def test_every_neuron_config_attribute_has_a_group() -> None:
    assert all(info.group is not None for info in infos(NeuronSpec).values())


def test_the_docs_page_is_generated_from_the_declarations() -> None:
    expected = reference.render_markdown(reference.reference_rows())
    assert DOCS.read_text() == expected, "regenerate it: nxdi config --list --markdown > docs/neuron-config.md"


def test_the_reference_lists_every_attribute_once() -> None:
    rows = reference.reference_rows()
    names = [r.name for r in rows]
    assert len(names) == len(set(names))
    top = {f.name for f in attrs.fields(NeuronSpec)} - {"moe"}
    assert top | {f.name for f in attrs.fields(MoESpec)} <= set(names)
    assert "on_device_sampling_config.global_topk" in names and "lora_config.max_loras" in names


def test_refused_and_inert_verdicts_reach_nested_attributes() -> None:
    rows = {r.name: r for r in reference.reference_rows()}
    assert rows["lora_config.max_loras"].cpu is OnCpu.YES  # static multi-LoRA runs on the CPU
    assert rows["lora_config.dynamic_multi_lora"].cpu is OnCpu.YES  # so does dynamic multi-LoRA
    assert rows["lora_config.lora_bias"].cpu is OnCpu.REFUSED  # adapter biases are not applied
    assert rows["router_config.act_fn"].cpu is OnCpu.YES  # the CPU MoE block routes with it
    assert rows["moe_ep_degree"].cpu is OnCpu.YES  # expert groups of ranks on the CPU engine
    assert rows["on_device_sampling_config.top_k"].cpu is OnCpu.YES


def test_every_flag_has_its_description_as_help() -> None:
    parser = argparse.ArgumentParser()
    add_neuron_config_flags(parser)
    flags = [a for a in parser._actions if a.dest.startswith("nc_")]
    assert flags and all(a.help for a in flags)
    by_name = {a.dest.removeprefix("nc_"): a.help for a in flags}
    assert by_name["tp_degree"] is not None and by_name["tp_degree"].startswith(infos(NeuronSpec)["tp_degree"].doc)
    assert "[no effect on CPU]" in str(by_name["qkv_kernel_enabled"])


def test_nxdi_config_list_prints_every_attribute(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--list"]) == 0
    out = capsys.readouterr().out
    rows = reference.reference_rows()
    assert f"{len(rows)} attributes" in out
    assert all(f"  {r.name} = " in out for r in rows)
