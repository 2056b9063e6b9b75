"""compile() / load(): artifacts, reuse, a fresh process, integrity errors, weights stored once."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from nxdi import NeuronConfig, OnDeviceSamplingConfig, load_pretrained_config
from nxdi.shell.exceptions import ArtifactIntegrityError
from nxdi.shell.generation import HuggingFaceGenerationAdapter
from nxdi.shell.models import LlamaInferenceConfig, NeuronLlamaForCausalLM
from nxdi.testing import checkpoints

IDS = torch.tensor([[0, 0, 0, 1, 5, 7], [4, 5, 6, 8, 9, 3]])
MASK = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
GEN = GenerationConfig(max_new_tokens=40, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    return checkpoints.build_checkpoint(tmp_path_factory.mktemp("llama"), "llama", checkpoints.SaveFormat.SAFETENSORS)


def _config(path: Path, **kw: object) -> LlamaInferenceConfig:
    neuron = NeuronConfig(
        batch_size=2,
        max_context_length=32,
        seq_len=160,
        enable_bucketing=True,
        torch_dtype="float32",
        on_device_sampling_config=OnDeviceSamplingConfig(top_k=1),
        **kw,
    )
    return LlamaInferenceConfig(neuron, load_config=load_pretrained_config(path))


@pytest.fixture(scope="module")
def compiled(llama: tuple[Path, object], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("compiled")
    NeuronLlamaForCausalLM(llama[0], _config(llama[0], save_sharded_checkpoint=True)).compile(out)
    return out


def test_compiled_folder_layout(compiled: Path) -> None:
    names = sorted(p.name for p in (compiled / "programs").iterdir())
    assert names == ["context_encoding_32.pt2", "token_generation_128.pt2", "token_generation_160.pt2"]
    manifest = json.loads((compiled / "manifest.json").read_text())
    assert set(manifest["files"]) >= {
        "neuron_config.json",
        "weights/tp0_sharded_checkpoint.safetensors",
    }
    # Weights are stored once: their bytes are in the weights file and in no program file.
    from safetensors.torch import load_file

    stored = load_file(compiled / "weights" / "tp0_sharded_checkpoint.safetensors")
    snippets = [
        stored[k].flatten()[40:56].numpy().tobytes() for k in ("embed_tokens.weight", "layers.1.mlp.down_proj.weight")
    ]
    weights_bytes = (compiled / "weights" / "tp0_sharded_checkpoint.safetensors").read_bytes()
    assert all(s in weights_bytes for s in snippets)  # the probe finds weights where they are
    for name in names:
        with zipfile.ZipFile(compiled / "programs" / name) as archive:
            content = b"".join(archive.read(member) for member in archive.namelist())
        assert not any(s in content for s in snippets), name


def test_load_generates_like_transformers(compiled: Path, llama: tuple[Path, object]) -> None:
    model = NeuronLlamaForCausalLM(compiled)
    model.load(compiled)
    assert model.is_compiled and model.is_loaded_to_neuron
    ours = HuggingFaceGenerationAdapter(model).generate(IDS, attention_mask=MASK, generation_config=GEN)
    assert torch.equal(ours, llama[1].generate(IDS, attention_mask=MASK, generation_config=GEN))


def test_compiling_again_reuses_programs(compiled: Path, llama: tuple[Path, object]) -> None:
    model = NeuronLlamaForCausalLM(llama[0], _config(llama[0], save_sharded_checkpoint=True, skip_warmup=True))
    model.compile(compiled)  # skip_warmup does not change a graph
    assert model._last_compile.traced == () and len(model._last_compile.reused) == 3


def test_fresh_process_loads_without_tracing(compiled: Path) -> None:
    script = textwrap.dedent(f"""
        import torch, torch.export
        calls = []
        real = torch.export.export
        torch.export.export = lambda *a, **k: calls.append(1) or real(*a, **k)
        from nxdi.shell.models import NeuronLlamaForCausalLM
        m = NeuronLlamaForCausalLM({str(compiled)!r}); m.load({str(compiled)!r})
        out = m(torch.tensor([[1, 5, 7]]).repeat(2, 1))
        print("traced", len(calls), "tokens", out.tokens.tolist())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "traced 0 tokens" in done.stdout


def test_nothing_compiled_is_file_not_found(tmp_path: Path, llama: tuple[Path, object]) -> None:
    model = NeuronLlamaForCausalLM(llama[0], _config(llama[0]))
    with pytest.raises(FileNotFoundError):
        model.load(tmp_path)


def test_corrupt_program_is_named(compiled: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(compiled, broken)
    program = broken / "programs" / "token_generation_128.pt2"
    data = bytearray(program.read_bytes())
    data[len(data) // 2] ^= 0xFF
    program.write_bytes(bytes(data))
    with pytest.raises(ArtifactIntegrityError, match="token_generation_128"):
        NeuronLlamaForCausalLM(broken).load(broken)


def test_mismatched_configuration_is_reported(compiled: Path, llama: tuple[Path, object]) -> None:
    other = NeuronLlamaForCausalLM(llama[0], _config(llama[0], save_sharded_checkpoint=True, fused_qkv=True))
    with pytest.raises(ArtifactIntegrityError, match="graph_key"):
        other.load(compiled)


def test_weights_from_the_original_checkpoint(llama: tuple[Path, object], tmp_path: Path) -> None:
    NeuronLlamaForCausalLM(llama[0], _config(llama[0])).compile(tmp_path)
    assert not (tmp_path / "weights").exists()
    model = NeuronLlamaForCausalLM(tmp_path)
    model.load(tmp_path)
    out = HuggingFaceGenerationAdapter(model).generate(IDS, attention_mask=MASK, generation_config=GEN)
    assert torch.equal(out, llama[1].generate(IDS, attention_mask=MASK, generation_config=GEN))


def test_interrupted_compile_leaves_nothing_loadable(
    llama: tuple[Path, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nxdi.effects.backends import cpu

    def boom(*args: object, **kwargs: object) -> object:
        raise KeyboardInterrupt

    monkeypatch.setattr(cpu.CpuBackend, "compile", boom)
    with pytest.raises(KeyboardInterrupt):
        NeuronLlamaForCausalLM(llama[0], _config(llama[0])).compile(tmp_path)
    assert not (tmp_path / "manifest.json").exists()
    with pytest.raises(FileNotFoundError):
        NeuronLlamaForCausalLM(tmp_path).load(tmp_path)


def test_a_folder_compiled_by_an_older_nxdi_is_refused(compiled: Path, tmp_path: Path) -> None:
    import shutil

    old = tmp_path / "old"
    shutil.copytree(compiled, old)
    doc = json.loads((old / "manifest.json").read_text())
    for program in doc["programs"]:  # formats 2 and 3 recorded phase and bucket, not the whole program key
        program["bucket"] = program.pop("length")
        del program["batch"], program["tokens"]
    from nxdi.effects.artifacts import FORMAT

    for version in range(1, FORMAT):  # 2 did not pin the original checkpoint, 1 named its programs
        (old / "manifest.json").write_text(json.dumps(doc | {"format": version}))
        expected = rf"older nxdi \(manifest format {version}; this nxdi reads {FORMAT}\).*compile again"
        with pytest.raises(ArtifactIntegrityError, match=expected):
            NeuronLlamaForCausalLM(old).load(old)


def test_load_weights_alone_brings_a_model_up(compiled: Path, llama: tuple[Path, object]) -> None:
    model = NeuronLlamaForCausalLM(compiled)
    model.load_weights(compiled)  # no load() first: it reads the programs itself
    out = HuggingFaceGenerationAdapter(model).generate(IDS, attention_mask=MASK, generation_config=GEN)
    assert torch.equal(out, llama[1].generate(IDS, attention_mask=MASK, generation_config=GEN))


def test_a_missing_original_checkpoint_is_file_not_found(llama: tuple[Path, object], tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "checkpoint"
    shutil.copytree(llama[0], copy)
    compiled = tmp_path / "compiled"
    NeuronLlamaForCausalLM(copy, _config(copy)).compile(compiled)
    (copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"holds no checkpoint.*save_sharded_checkpoint=True"):
        NeuronLlamaForCausalLM(compiled).load(compiled)


def test_the_persistent_compile_cache_serves_a_new_folder(
    llama: tuple[Path, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On by default (here pointed at a temporary folder): the same model compiled into a second
    folder traces nothing; a cache that cannot be written leaves compiles working."""
    monkeypatch.setenv("NXDI_COMPILE_CACHE", str(tmp_path / "cache"))
    first = NeuronLlamaForCausalLM(llama[0], _config(llama[0]))
    first.compile(tmp_path / "a")
    assert len(first._last_compile.traced) == 3 and len(list((tmp_path / "cache").iterdir())) == 3
    second = NeuronLlamaForCausalLM(llama[0], _config(llama[0]))
    second.compile(tmp_path / "b")
    assert second._last_compile.traced == () and len(second._last_compile.reused) == 3
    second.load(tmp_path / "b")
    ours = HuggingFaceGenerationAdapter(second).generate(IDS, attention_mask=MASK, generation_config=GEN)
    assert torch.equal(ours, llama[1].generate(IDS, attention_mask=MASK, generation_config=GEN))

    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("NXDI_COMPILE_CACHE", str(tmp_path / "file" / "cache"))
    third = NeuronLlamaForCausalLM(llama[0], _config(llama[0]))
    third.compile(tmp_path / "c")
    assert len(third._last_compile.traced) == 3
