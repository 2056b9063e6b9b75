"""The layer contract: shell -> effects -> core, a pure core, and no work at import.

import-linter (pyproject.toml) checks the module-level import edges. This test is at least as
strict and sees what import-linter cannot: imports inside functions, calls to `open()`/`print()`,
environment reads, the global torch RNG, and statements that run at import time. The last two
tests import the package in fresh interpreters and watch what happens.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nxdi"

IO_MODULES = frozenset(
    {"os", "pathlib", "shutil", "tempfile", "io", "glob", "subprocess", "socket", "time", "random", "secrets"}
    | {"importlib", "logging", "multiprocessing", "threading", "signal", "ctypes"}
)
TOOLCHAIN = frozenset({"torch_neuronx", "torch_xla", "neuronx_cc", "libneuronxla", "safetensors", "transformers"})
TENSOR_LIBS = frozenset({"torch", "numpy"})
IO_BUILTINS = frozenset({"open", "print", "input", "exec", "eval", "compile", "__import__", "breakpoint"})
ENV_NAMES = frozenset({"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"})
GLOBAL_TORCH_STATE = frozenset(
    {"torch.manual_seed", "torch.seed", "torch.initial_seed", "torch.set_rng_state", "torch.get_rng_state"}
    | {"torch.compile", "torch.set_default_device", "torch.set_default_dtype", "torch.set_num_threads"}
    | {"torch.use_deterministic_algorithms", "torch.cuda", "torch.random", "torch._dynamo", "torch._inductor"}
)
SAMPLERS = frozenset(
    {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "multinomial"}
    | {"bernoulli", "normal", "poisson", "normal_", "uniform_", "bernoulli_", "exponential_", "random_"}
    | {"geometric_", "cauchy_", "log_normal_"}
)
"""Functions and tensor methods that draw from torch's global RNG unless given `generator=`."""


class Module:
    """One source file of the package, parsed."""

    def __init__(self, path: Path) -> None:
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        self.path = path
        self.name = ".".join(parts)
        self.package = self.name if rel.name == "__init__" else self.name.rpartition(".")[0]
        self.tree = ast.parse(path.read_text(), filename=str(path))
        self.aliases = self._aliases()

    def where(self, node: ast.AST) -> str:
        return f"{self.path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"

    def imports(self) -> Iterator[tuple[ast.AST, str]]:
        """Every imported module name (absolute), anywhere in the file; `from a import b` yields a and a.b."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield node, alias.name
            elif isinstance(node, ast.ImportFrom):
                base = self._resolve(node)
                yield node, base
                for alias in node.names:
                    yield node, f"{base}.{alias.name}"

    def _resolve(self, node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        parts = self.package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1])
        return f"{base}.{node.module}" if node.module else base

    def _aliases(self) -> dict[str, str]:
        """Local name -> the dotted module path it stands for (`import torch.nn.functional as F`)."""
        names: dict[str, str] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    local = alias.asname or alias.name.partition(".")[0]
                    names[local] = alias.name if alias.asname else local
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{self._resolve(node)}.{alias.name}"
        return names

    def dotted(self, node: ast.AST) -> str | None:
        """`torch.cuda.is_available` for an attribute chain, with its first name resolved through imports."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        parts.append(self.aliases.get(node.id, node.id))
        return ".".join(reversed(parts))


def _modules(*layers: str) -> list[Module]:
    found = [Module(p) for p in sorted(PACKAGE.rglob("*.py"))]
    return [m for m in found if any(m.name == layer or m.name.startswith(f"{layer}.") for layer in layers)]


TENSOR_PACKAGES = ("nxdi.core.programs", "nxdi.core.host")
"""The core packages that compute with tensors (traced programs, host-side helpers); the rest of core plans."""


def _is_planner(m: Module) -> bool:
    return not _under(m.name, *TENSOR_PACKAGES)


def _top(name: str) -> str:
    return name.partition(".")[0]


def _under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in packages)


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _report(violations: list[str]) -> str:
    return "\n".join(["layer contract violated:", *violations])


def test_the_package_has_all_three_layers() -> None:
    names = {m.name for m in _modules("nxdi")}
    assert {"nxdi.core", "nxdi.effects", "nxdi.shell", "nxdi.core.model_spec"} <= names


def test_core_imports_no_higher_layer() -> None:
    bad = [
        f"{m.where(node)} imports {name}"
        for m in _modules("nxdi.core")
        for node, name in m.imports()
        if name == "nxdi" or _under(name, "nxdi.effects", "nxdi.shell")
    ]
    assert not bad, _report(bad)


def test_effects_imports_no_shell() -> None:
    bad = [
        f"{m.where(node)} imports {name}"
        for m in _modules("nxdi.effects")
        for node, name in m.imports()
        if name == "nxdi" or _under(name, "nxdi.shell")
    ]
    assert not bad, _report(bad)


def test_core_does_no_io_and_never_touches_the_toolchain() -> None:
    bad = [
        f"{m.where(node)} imports {name}"
        for m in _modules("nxdi.core")
        for node, name in m.imports()
        if _top(name) in IO_MODULES | TOOLCHAIN
    ]
    for m in _modules("nxdi.core"):
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in IO_BUILTINS:
                bad.append(f"{m.where(node)} calls {node.func.id}()")
    assert not bad, _report(bad)


def test_core_planners_import_no_torch() -> None:
    bad = [
        f"{m.where(node)} imports {name}"
        for m in _modules("nxdi.core")
        if _is_planner(m)
        for node, name in m.imports()
        if _top(name) in TENSOR_LIBS or _under(name, *TENSOR_PACKAGES)
    ]
    assert not bad, _report(bad)


def test_core_never_uses_global_torch_state() -> None:
    bad = []
    for m in _modules("nxdi.core"):
        for node in ast.walk(m.tree):
            name = m.dotted(node) if isinstance(node, ast.Attribute) else None
            if name is not None and any(_under(name, g) for g in GLOBAL_TORCH_STATE):
                bad.append(f"{m.where(node)} uses {name}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                seeded = any(k.arg == "generator" and not _is_none(k.value) for k in node.keywords)
                if node.func.attr in SAMPLERS and not seeded:
                    bad.append(f"{m.where(node)} calls .{node.func.attr}() without generator=")
    assert not bad, _report(bad)


def test_only_effects_env_reads_the_environment() -> None:
    bad = []
    for m in _modules("nxdi"):
        if m.name == "nxdi.effects.env":
            continue
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Attribute) and node.attr in ENV_NAMES:
                bad.append(f"{m.where(node)} reads .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and any(a.name in ENV_NAMES for a in node.names):
                bad.append(f"{m.where(node)} imports {', '.join(a.name for a in node.names)} from {node.module}")
    assert not bad, _report(bad)


def _is_import_time_work(node: ast.stmt) -> bool:
    """True for a module-level statement that does more than define names."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return False
    if isinstance(node, ast.Expr):
        return not isinstance(node.value, ast.Constant)  # a docstring is fine; a bare call is work
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return not all(isinstance(t, ast.Name) for t in targets)  # `torch.x.config.y = 1` is work
    if isinstance(node, ast.If) and ast.unparse(node.test) in ("__name__ == '__main__'", '__name__ == "__main__"'):
        return False  # runs as a script only, never on import
    if isinstance(node, ast.If) and any(flag in ast.unparse(node.test) for flag in ("TYPE_CHECKING", "version_info")):
        return any(_is_import_time_work(s) for s in node.body + node.orelse)
    return True  # try/with/for/while/if at module level


def test_modules_do_no_work_at_import() -> None:
    bad = [
        f"{m.where(node)} runs at import: {ast.unparse(node).splitlines()[0][:80]}"
        for m in _modules("nxdi")
        for node in m.tree.body
        if _is_import_time_work(node)
    ]
    assert not bad, _report(bad)


def _run(script: str, *args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=PACKAGE.parent,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


NO_TORCH_SCRIPT = r"""
import importlib, json, sys
culprits = []
for name in ["nxdi", *sys.argv[1:]]:
    importlib.import_module(name)
    if "torch" in sys.modules and not culprits:
        culprits.append(name)
print(json.dumps({"culprits": culprits}))
"""


def test_importing_nxdi_and_the_planners_loads_no_torch() -> None:
    planners = [m.name for m in _modules("nxdi.core") if _is_planner(m)]
    result = _run(NO_TORCH_SCRIPT, *planners)
    assert result["culprits"] == [], f"importing {result['culprits']} imported torch"


IMPORT_ALL_SCRIPT = r"""
import collections.abc, importlib, json, os, pkgutil, sys

import torch  # imported first: its own import-time env reads are not nxdi's

package_dir = os.path.join(os.getcwd(), "nxdi") + os.sep
reads = []


class Recorder(collections.abc.MutableMapping):
    # Stands in for os.environ and records which nxdi source line read it.
    def __init__(self, real):
        self.real = real

    def _note(self, key):
        frame = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__") in ("os", "collections.abc", "_collections_abc"):
            frame = frame.f_back
        if frame is not None and frame.f_code.co_filename.startswith(package_dir):
            reads.append(f"{frame.f_code.co_filename[len(package_dir):]}:{frame.f_lineno} reads {key!r}")

    def __getitem__(self, key):
        self._note(key)
        return self.real[key]

    def __iter__(self):
        self._note("*")
        return iter(self.real)

    def __len__(self):
        return len(self.real)

    def __setitem__(self, key, value):
        self._note(key)
        self.real[key] = value

    def __delitem__(self, key):
        self._note(key)
        del self.real[key]

    def copy(self):
        self._note("*")
        return dict(self.real)


def torch_state():
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor

    return repr((dynamo.get_config_copy(), inductor.get_config_copy(), torch.get_num_threads(),
                 torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled()))


before = torch_state()
os.environ = Recorder(os.environ)
import nxdi

failed = []
for info in pkgutil.walk_packages(nxdi.__path__, "nxdi.", onerror=failed.append):
    try:
        importlib.import_module(info.name)
    except Exception as e:
        failed.append(f"{info.name}: {type(e).__name__}: {e}")
os.environ = os.environ.real
print(json.dumps({
    "reads": reads,
    "failed": failed,
    "toolchain": sorted(m for m in ("torch_neuronx", "torch_xla", "neuronx_cc", "libneuronxla") if m in sys.modules),
    "torch_state_changed": torch_state() != before,
}))
"""


def test_importing_every_module_reads_no_env_probes_no_device_and_sets_no_torch_config() -> None:
    result = _run(IMPORT_ALL_SCRIPT)
    assert result["failed"] == [], f"modules that fail to import: {result['failed']}"
    assert result["reads"] == [], f"environment reads at import time: {result['reads']}"
    assert result["toolchain"] == [], f"imported at import time (import them lazily): {result['toolchain']}"
    assert result["torch_state_changed"] is False, "a module changed torch settings at import time"


@pytest.mark.parametrize(
    ("source", "work"),
    [
        ('"""Doc."""\nimport attrs\nX: int = 1\nclass A: ...\ndef f() -> None: ...', False),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch", False),
        ("import torch\ntorch.set_num_threads(1)", True),
        ("import torch\ntorch._inductor.config.freezing = True", True),
        ("try:\n    import torch_neuronx\nexcept ImportError:\n    pass", True),
        ("REGISTRY = {}\nREGISTRY['llama'] = 1", True),
        ("def main() -> None: ...\nif __name__ == '__main__':\n    main()", False),
        ("import sys\nif sys.argv:\n    pass", True),
    ],
)
def test_import_time_work_detector(source: str, work: bool) -> None:
    assert any(_is_import_time_work(s) for s in ast.parse(source).body) is work
