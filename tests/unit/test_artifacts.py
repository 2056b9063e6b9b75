"""The compiled-model folder: reuse by graph key, weights stored once, integrity checks, atomicity."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from returns.pipeline import is_successful

from nxdi.core.planning.program_key import ProgramKey
from nxdi.effects import artifacts
from nxdi.effects.backends.base import FlatProgram, WeightSet
from nxdi.effects.backends.cpu import CpuBackend
from nxdi.shell.exceptions import ArtifactIntegrityError, unwrap
from tests.support import cpu_programs as cp

REPO = Path(__file__).resolve().parents[2]
BACKEND = CpuBackend()


def requests(fn: FlatProgram = cp.step, buckets: tuple[int, ...] = (1, 4)) -> list[artifacts.ProgramRequest]:
    return [
        artifacts.ProgramRequest(
            key=ProgramKey.token(s, cp.B), fn=fn, signature=cp.SIGNATURE, example=lambda s=s: cp.example(s)
        )
        for s in buckets
    ]


@pytest.fixture
def compiled(tmp_path: Path) -> Path:
    """A folder holding two compiled programs (buckets of 1 and 4 tokens)."""
    artifacts.compile_programs(tmp_path, requests(), graph_key="key-a", backend=BACKEND)
    return tmp_path


def calls_during(action: Callable[[], object]) -> int:
    before = cp.CALLS["n"]
    action()
    return cp.CALLS["n"] - before


def test_load_in_a_fresh_process_gives_identical_outputs_without_tracing(compiled: Path, tmp_path: Path) -> None:
    out = tmp_path / "outputs.pt"
    script = textwrap.dedent(
        f"""
        import torch
        def refuse(*args, **kwargs):
            raise AssertionError("load traced or compiled again")
        torch.export.export = torch.compile = torch.jit.trace = refuse
        from nxdi.core.planning.program_key import ProgramKey
        from nxdi.effects import artifacts
        from nxdi.effects.backends.base import WeightSet
        from nxdi.effects.backends.cpu import CpuBackend
        from tests.support import cpu_programs as cp
        backend = CpuBackend()
        programs = artifacts.load_programs({str(compiled)!r}, backend, graph_key="key-a").unwrap()
        loaded = backend.bind(programs[ProgramKey.token(4, cp.B)], WeightSet(tensors=cp.weights(0))).unwrap()
        (y,), (cache,) = backend.run(loaded, [torch.zeros(cp.B, cp.T, cp.E)], cp.inputs(1, 4, 0))
        assert cp.CALLS["n"] == 0, "the program body ran"
        torch.save({{"y": y, "cache": cache}}, {str(out)!r})
        """
    )
    subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True, timeout=300)
    got = torch.load(out)
    want_y, want_cache = cp.step(*cp.weights(0), torch.zeros(cp.B, cp.T, cp.E), *cp.inputs(1, 4, 0))
    torch.testing.assert_close(got["y"], want_y)
    torch.testing.assert_close(got["cache"], want_cache)


def test_compiling_an_unchanged_config_again_reuses_every_program(compiled: Path) -> None:
    before = (compiled / "manifest.json").read_text()
    result = artifacts.compile_programs(compiled, requests(), graph_key="key-a", backend=BACKEND)
    assert result.traced == () and result.reused == ("token_generation_1", "token_generation_4")
    assert (compiled / "manifest.json").read_text() == before


def test_a_different_graph_key_recompiles(compiled: Path) -> None:
    traced = calls_during(lambda: artifacts.compile_programs(compiled, requests(), graph_key="b", backend=BACKEND))
    assert traced >= 2
    assert artifacts.read_manifest(compiled).unwrap().graph_key == "b"


def test_a_new_bucket_traces_only_that_bucket(compiled: Path) -> None:
    result = artifacts.compile_programs(compiled, requests(buckets=(1, 4, 8)), graph_key="key-a", backend=BACKEND)
    assert result.traced == ("token_generation_8",)


def test_removed_buckets_leave_no_files(compiled: Path) -> None:
    artifacts.compile_programs(compiled, requests(buckets=(4,)), graph_key="key-a", backend=BACKEND)
    assert sorted(p.name for p in (compiled / "programs").iterdir()) == ["token_generation_4.pt2"]


def test_the_cache_dir_shares_programs_across_folders(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    artifacts.compile_programs(tmp_path / "a", requests(), graph_key="k", backend=BACKEND, cache_dir=cache)
    result = artifacts.compile_programs(tmp_path / "b", requests(), graph_key="k", backend=BACKEND, cache_dir=cache)
    assert result.traced == ()
    assert is_successful(artifacts.load_programs(tmp_path / "b", BACKEND))


def test_the_cache_key_covers_graph_key_program_backend_version_and_code() -> None:
    base = ("g", "token_generation_1", "cpu", "cpu-export-1/torch-2.13.0", "c")
    keys = {artifacts.program_key(*base)}
    for i, other in enumerate(("g2", "context_encoding_1", "neuron", "cpu-export-1/torch-2.14.0", "c2")):
        keys.add(artifacts.program_key(*base[:i], other, *base[i + 1 :]))
    assert len(keys) == 6
    assert BACKEND.version().endswith(torch.__version__)
    assert len(artifacts.code_version()) == 64 and artifacts.code_version() == artifacts.code_version()


def test_programs_traced_by_other_nxdi_code_are_not_reused(
    compiled: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp_path = tmp_path_factory.mktemp("elsewhere")  # `compiled` is this test's tmp_path
    cache = tmp_path / "cache"
    artifacts.compile_programs(tmp_path / "a", requests(), graph_key="key-a", backend=BACKEND, cache_dir=cache)
    monkeypatch.setattr(artifacts, "code_version", lambda: "edited")  # an upgrade, or a local edit
    # neither the cache's programs nor a folder's own
    for folder, cache_dir in ((tmp_path / "b", cache), (compiled, None)):
        result = artifacts.compile_programs(folder, requests(), graph_key="key-a", backend=BACKEND, cache_dir=cache_dir)
        assert result.traced == ("token_generation_1", "token_generation_4") and result.reused == ()


def test_program_files_hold_no_weight_bytes(compiled: Path) -> None:
    w = torch.randn(512, 512)  # 1 MiB of weights: far larger than the program files
    big = [
        artifacts.ProgramRequest(
            key=ProgramKey.context(s, cp.B),
            fn=cp.step,
            signature=cp.SIGNATURE,
            example=lambda s=s: (
                w,
                torch.randn(cp.V, 512),
                torch.zeros(cp.B, cp.T, 512),
                torch.zeros(cp.B, s, 512),
                torch.arange(s),
            ),
        )
        for s in (1, 4)
    ]
    artifacts.compile_programs(compiled, big, graph_key="big", backend=BACKEND)
    needle = w[7].numpy().tobytes()[:256]
    for path in (compiled / "programs").iterdir():
        assert path.stat().st_size < w.numel() * w.element_size() / 4
        assert needle not in path.read_bytes()


def test_rebinding_new_weights_uses_them(compiled: Path) -> None:
    program = unwrap(artifacts.load_programs(compiled, BACKEND))[ProgramKey.token(1, cp.B)]
    for seed in (3, 4):
        w = cp.weights(seed)
        (y,), _ = BACKEND.run(
            BACKEND.bind(program, WeightSet(tensors=w)).unwrap(), [torch.zeros(cp.B, cp.T, cp.E)], cp.inputs(5, 1, 2)
        )
        torch.testing.assert_close(y, cp.step(*w, torch.zeros(cp.B, cp.T, cp.E), *cp.inputs(5, 1, 2))[0])


def test_a_flipped_byte_is_reported_naming_the_file(compiled: Path) -> None:
    path = compiled / "programs" / "token_generation_4.pt2"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    result = artifacts.load_programs(compiled, BACKEND)
    assert not is_successful(result)
    with pytest.raises(ArtifactIntegrityError, match=r"token_generation_4\.pt2") as info:
        unwrap(result)
    assert [p.field for p in info.value.error.problems] == [str(path)]


def test_every_missing_or_truncated_file_is_named(compiled: Path) -> None:
    (compiled / "programs" / "token_generation_1.pt2").unlink()
    p4 = compiled / "programs" / "token_generation_4.pt2"
    p4.write_bytes(p4.read_bytes()[:100])
    message = artifacts.load_programs(compiled, BACKEND).failure().render()
    assert "token_generation_1.pt2" in message and "missing" in message
    assert "token_generation_4.pt2" in message and "100 bytes" in message


def test_a_folder_with_nothing_compiled_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"manifest\.json"):
        unwrap(artifacts.load_programs(tmp_path, BACKEND))


def test_a_malformed_manifest_is_named(compiled: Path) -> None:
    (compiled / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactIntegrityError, match=r"manifest\.json"):
        unwrap(artifacts.load_programs(compiled, BACKEND))


def test_another_torch_version_or_graph_key_is_refused(compiled: Path) -> None:
    path = compiled / "manifest.json"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(doc | {"backend_version": "cpu-export-1/torch-0.0.1"}))
    message = artifacts.load_programs(compiled, BACKEND, graph_key="other").failure().render()
    assert "torch-0.0.1" in message and "graph_key" in message


def test_an_interrupted_compile_leaves_no_manifest_and_no_temporaries(compiled: Path) -> None:
    broken = [*requests(buckets=(2,)), *requests(fn=cp.broken_step, buckets=(3,))]
    with pytest.raises(RuntimeError, match="simulated failure"):
        artifacts.compile_programs(compiled, broken, graph_key="new-key", backend=BACKEND)
    assert not (compiled / "manifest.json").exists()
    assert not [p for p in (compiled / "programs").iterdir() if p.name.startswith(".tmp-")]
    with pytest.raises(FileNotFoundError):
        unwrap(artifacts.load_programs(compiled, BACKEND))


def test_a_failed_save_leaves_no_partial_program_file(tmp_path: Path) -> None:
    class FailingSave(CpuBackend):
        def save(self, program: object, path: Path) -> None:
            path.write_bytes(b"half a program")
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        artifacts.compile_programs(tmp_path, requests(), graph_key="k", backend=FailingSave())
    assert [p.name for p in (tmp_path / "programs").iterdir()] == []
    assert not (tmp_path / "manifest.json").exists()


def test_recorded_files_are_verified_too(tmp_path: Path) -> None:
    (tmp_path / "neuron_config.json").write_text('{"batch_size": 1}')
    artifacts.compile_programs(tmp_path, requests(), graph_key="k", backend=BACKEND, record=["neuron_config.json"])
    (tmp_path / "neuron_config.json").write_text('{"batch_size": 2}')
    with pytest.raises(ArtifactIntegrityError, match=r"neuron_config\.json"):
        unwrap(artifacts.load_programs(tmp_path, BACKEND))


def test_each_program_key_is_compiled_once(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        ProgramKey.token(0, cp.B)
    with pytest.raises(ValueError, match="two requests for one program"):
        artifacts.compile_programs(tmp_path, requests(buckets=(1, 1)), graph_key="k", backend=BACKEND)


def test_the_manifest_records_the_program_keys_and_older_formats_are_refused(compiled: Path) -> None:
    manifest = artifacts.read_manifest(compiled).unwrap()
    assert {p.key for p in manifest.programs} == {ProgramKey.token(1, cp.B), ProgramKey.token(4, cp.B)}
    doc = json.loads((compiled / "manifest.json").read_text())
    fields = [(p["phase"], p["length"], p["batch"], p["tokens"]) for p in doc["programs"]]
    assert fields == [("token_generation", 1, cp.B, 1), ("token_generation", 4, cp.B, 1)]
    for version in range(1, artifacts.FORMAT):  # 3 recorded phase and bucket only, not the batch
        (compiled / "manifest.json").write_text(json.dumps(doc | {"format": version}))
        with pytest.raises(ArtifactIntegrityError, match=rf"older nxdi \(manifest format {version}.*compile again"):
            unwrap(artifacts.load_programs(compiled, BACKEND))


def test_programs_of_one_length_and_several_batch_sizes_are_told_apart(tmp_path: Path) -> None:
    """Batch buckets: the phase's largest batch keeps the plain name, the others get `_b<batch>`."""
    keys = [ProgramKey.token(4, 1), ProgramKey.token(4, cp.B), ProgramKey.token(1, cp.B)]
    reqs = [
        artifacts.ProgramRequest(key=k, fn=cp.step, signature=cp.SIGNATURE, example=lambda k=k: cp.example(k.length))
        for k in keys
    ]
    result = artifacts.compile_programs(tmp_path, reqs, graph_key="k", backend=BACKEND)
    assert result.traced == ("token_generation_4_b1", "token_generation_4", "token_generation_1")
    names = sorted(p.name for p in (tmp_path / "programs").iterdir())
    assert names == ["token_generation_1.pt2", "token_generation_4.pt2", "token_generation_4_b1.pt2"]
    assert set(unwrap(artifacts.load_programs(tmp_path, BACKEND))) == set(keys)


def test_a_build_folder_links_the_unchanged_programs_of_the_previous_folder(compiled: Path, tmp_path: Path) -> None:
    build = tmp_path / "build"
    before = (compiled / "manifest.json").read_text()
    result = artifacts.compile_programs(
        build, requests(buckets=(4, 8)), graph_key="key-a", backend=BACKEND, previous=compiled
    )
    assert result.traced == ("token_generation_8",) and result.reused == ("token_generation_4",)
    rel = "programs/token_generation_4.pt2"
    assert (build / rel).stat().st_ino == (compiled / rel).stat().st_ino  # a hard link, no copy
    assert (compiled / "manifest.json").read_text() == before  # the previous folder is only read
    assert is_successful(artifacts.load_programs(build, BACKEND))
