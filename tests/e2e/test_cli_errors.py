"""`nxdi` on user errors: exit 2, one message, no traceback (unless --debug), nothing compiled, and
the user's files byte-identical afterwards; unexpected errors keep their traceback."""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from nxdi.shell.cli import cmd_config
from nxdi.shell.cli.main import main
from nxdi.shell.exceptions import (
    ArtifactIntegrityError,
    CheckpointValidationError,
    FolderLockedError,
    IncompatibleConfigError,
    RankError,
)
from tests.support.user_files import broken_copy, denied_runner, mode, run_nxdi, snapshot

SMALL = ("--torch-dtype", "float32", "--seq-len", "32", "--max-context-length", "16")


@pytest.fixture
def llama(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> Path:
    """A private copy of the tiny Llama checkpoint (tests may break it)."""
    return broken_copy(tiny_checkpoint("llama"), tmp_path / "llama")


def _fails_cleanly(capsys: pytest.CaptureFixture[str], argv: list[str], *expected: str) -> str:
    """Run `nxdi argv`: exit 2, one line on stderr holding every `expected` text, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for text in expected:
        assert text in err, err
    return err


@pytest.mark.parametrize("kind", ["file", "inside a file", "/dev/null"])
@pytest.mark.parametrize("command", ["compile", "run"])
def test_compiled_model_path_that_is_not_a_folder_is_refused_before_compiling(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, command: str
) -> None:
    afile = tmp_path / "a-file"
    afile.write_bytes(b"user data\n")
    target = {"file": afile, "inside a file": afile / "out", "/dev/null": Path("/dev/null")}[kind]
    before = snapshot(llama), snapshot(afile)
    argv = [command, "--model-path", str(llama), "--compiled-model-path", str(target), *SMALL]
    argv += ["--input-ids", "1 2"] if command == "run" else []
    err = _fails_cleanly(capsys, argv, "--compiled-model-path", str(target), "not a folder")
    assert "compiling" not in capsys.readouterr().out
    assert (snapshot(llama), snapshot(afile)) == before
    assert stat.S_ISCHR(Path("/dev/null").stat().st_mode), err


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ("", "holds no token ids"),
        ("  ,  ", "holds no token ids"),
        ("1 two 3", "'two' is not an integer token id"),
        ("1.5", "'1.5' is not an integer token id"),
        ("999999", "token id 999999 is outside the model's vocabulary"),
        ("-1 4", "token id -1 is outside the model's vocabulary"),
        (" ".join(["3"] * 17), "a prompt of 17 tokens is longer than max_context_length=16"),
    ],
)
def test_bad_input_ids_are_refused_before_compiling(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], ids: str, expected: str
) -> None:
    out = tmp_path / "compiled"
    before = snapshot(llama)
    argv = ["run", "--model-path", str(llama), "--compiled-model-path", str(out), "--input-ids", ids, *SMALL]
    _fails_cleanly(capsys, argv, "--input-ids", expected)
    assert not out.exists() and snapshot(llama) == before


def test_run_without_a_prompt_is_refused_before_compiling(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "compiled"
    _fails_cleanly(capsys, ["run", "--model-path", str(llama), "--compiled-model-path", str(out)], "--input-ids")
    _fails_cleanly(
        capsys,
        ["run", "--model-path", str(llama), "--compiled-model-path", str(out), "--prompt", "hi"],
        "needs a tokenizer",
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("edit", "text", "expected"),
    [
        (None, '{"model_type": "llama",', "line 1 column"),
        (lambda d: d.update(hidden_size="64"), None, "hidden_size='64'"),
        (lambda d: d.update(num_attention_heads=5), None, "num_attention_heads=5"),
        (lambda d: d.pop("model_type"), None, "model_type"),
        (lambda d: d.update(rms_norm_eps=float("nan")), None, "rms_norm_eps"),
    ],
    ids=["invalid-json", "string-size", "heads-do-not-divide", "no-model-type", "nan-eps"],
)
def test_bad_config_json_fails_in_one_message_naming_the_file_and_field(
    tiny_checkpoint: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edit: Callable[[dict[str, object]], None] | None,
    text: str | None,
    expected: str,
) -> None:
    model = broken_copy(tiny_checkpoint("llama"), tmp_path / "m", edit, text=text)
    before = snapshot(model)
    out = tmp_path / "compiled"
    for argv in (["--model-type", "llama"], []):  # the model type given, or read from config.json
        assert main(["compile", *argv, "--model-path", str(model), "--compiled-model-path", str(out), *SMALL]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and expected in err, err
        assert "config.json" in err or "rms_norm_eps" in err, err
    assert snapshot(model) == before and not out.exists()


def test_argparse_errors_print_the_short_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--model-path", "m", "--batch-size", "x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.splitlines()[0]
        == "usage: nxdi run --model-path MODEL_PATH --compiled-model-path COMPILED_MODEL_PATH [options]"
    )
    assert "invalid int value: 'x'" in err and len(err.splitlines()) <= 4


def test_a_misspelled_flag_names_the_command_and_the_closest_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["compile", "--model-path", "m", "--compiled-model-path", "o", "--tp-degre", "2"])
    err = capsys.readouterr().err
    assert "nxdi compile: error: unrecognized arguments: --tp-degre 2" in err and "--tp-degree" in err
    assert len(err.splitlines()) <= 5


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (IncompatibleConfigError("Invalid configuration: 1 problem:\n  - tp_degree=3: bad"), 2),
        (CheckpointValidationError("Invalid checkpoint: 1 problem:\n  - w: missing"), 2),
        (ArtifactIntegrityError("Invalid compiled model: 1 problem:\n  - manifest.json: altered"), 2),
        (FileNotFoundError("nothing compiled at 'x'"), 2),
        (PermissionError(13, "Permission denied", "/x/config.json"), 2),
        (RankError("rank 1 died", 1), 1),
        (FolderLockedError("'out' is held by pid 7"), 1),
    ],
)
def test_documented_exceptions_become_one_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], exc: Exception, status: int
) -> None:
    def fail(args: object) -> int:
        raise exc

    monkeypatch.setattr(cmd_config, "run", fail)
    assert main(["config"]) == status
    err = capsys.readouterr().err
    assert err.startswith("nxdi config: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    with pytest.raises(type(exc)):  # --debug shows the traceback, before or after the command
        main(["--debug", "config"])
    with pytest.raises(type(exc)):
        main(["config", "--debug"])


def test_an_unexpected_error_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(args: object) -> int:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cmd_config, "run", fail)
    with pytest.raises(ZeroDivisionError):
        main(["config"])


def test_too_large_settings_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    _fails_cleanly(capsys, ["config", "--batch-size", str(2**63)], "batch_size=9223372036854775808", "<= 65536")


# --- unreadable or unwritable paths (run in a process without the rights; see tests.support.user_files) ---


def _denied(path: Path, *, write: bool = False) -> list[str]:
    prefix = denied_runner(path, write=write)
    if prefix is None:
        pytest.skip("cannot take away read or write rights here: running as root without util-linux setpriv")
    return prefix


@pytest.mark.parametrize("what", ["folder", "config.json"])
def test_an_unreadable_model_folder_or_config_json_fails_in_one_message(llama: Path, tmp_path: Path, what: str) -> None:
    locked = llama if what == "folder" else llama / "config.json"
    with mode(locked, 0):
        prefix = _denied(locked)
        done = run_nxdi(
            prefix, "run", "--model-path", str(llama), "--compiled-model-path", str(tmp_path / "c"), "--input-ids", "1"
        )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"{llama / 'config.json'}: Permission denied" in done.stderr
    assert not (tmp_path / "c").exists()


def test_an_unwritable_compiled_model_path_is_refused_before_compiling(llama: Path, tmp_path: Path) -> None:
    parent = tmp_path / "read-only"
    parent.mkdir()
    before = snapshot(llama)
    with mode(parent, 0o555):
        prefix = _denied(parent, write=True)
        for target in (parent, parent / "new"):
            done = run_nxdi(prefix, "compile", "--model-path", str(llama), "--compiled-model-path", str(target), *SMALL)
            assert done.returncode == 2, done.stderr
            assert f"--compiled-model-path {str(target)!r}" in done.stderr and "cannot be written" in done.stderr
            assert "Traceback" not in done.stderr and "compiled into" not in done.stdout
    assert list(parent.iterdir()) == [] and snapshot(llama) == before


def test_a_checkpoint_changed_since_compile_is_refused_until_run_with_repin_checkpoint(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file, save_file

    compiled = tmp_path / "compiled"
    common = ["--model-path", str(llama), "--compiled-model-path", str(compiled), *SMALL]
    assert main(["compile", *common]) == 0
    weights = llama / "model.safetensors"
    tensors = load_file(weights)
    name = next(iter(sorted(tensors)))
    tensors[name] = tensors[name] * 2
    save_file(tensors, weights, metadata={"format": "pt"})
    capsys.readouterr()
    run = ["run", *common, "--skip-compile", "--input-ids", "1 2 3"]
    _fails_cleanly(capsys, run, str(weights), "changed since compile", "repin_checkpoint=True")
    assert main([*run, "--repin-checkpoint"]) == 0
    assert main(run) == 0  # pinned again
