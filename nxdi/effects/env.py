"""Environment variables nxdi honours. Effects: reads os.environ (the only module that does).

`read_env()` returns a frozen `Env`; everything else takes the fields it needs as arguments, so
configuration stays a pure function of its inputs.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Iterator, Mapping

import attrs

from nxdi.core.platform import Platform


@attrs.frozen(kw_only=True)
class Torchrun:
    """What `torchrun` tells the process it started: this process is one rank of a world."""

    rank: int
    """RANK: this process's global rank."""
    world_size: int
    """WORLD_SIZE: ranks over every node."""
    local_rank: int
    """LOCAL_RANK: its rank on this node."""
    master_addr: str
    master_port: int


@attrs.frozen(kw_only=True)
class NeuronNodes:
    """Multi-node tensor parallelism as the transformers-neuronx guide configures it: every node
    runs the same script, its driver starting this node's ranks of one world."""

    root_addr: str
    """NEURON_RT_ROOT_COMM_ID's host: the master node, where the world meets."""
    root_port: int
    node_rank: int
    """NEURON_RANK_ID: this node (0: the master node)."""
    local_tp: int
    """NEURON_LOCAL_TP: ranks on each node; node n runs ranks n * local_tp .. (n + 1) * local_tp - 1."""


@attrs.frozen(kw_only=True)
class Env:
    """The environment as nxdi sees it."""

    logical_nc_config: int | None = None
    """NEURON_LOGICAL_NC_CONFIG, which overrides the logical_nc_config attribute."""
    platform_target: Platform | None = None
    """NEURON_PLATFORM_TARGET_OVERRIDE (trn1, trn2, trn3, inf2)."""
    rt_visible_cores: str | None = None
    """NEURON_RT_VISIBLE_CORES, for the Neuron runtime."""
    compile_cache_dir: str | None = None
    """Where compiled programs are cached across model folders (`compile_cache`): on by default, at
    `~/.cache/nxdi/compile-cache`; None when turned off."""
    kernel_dir: str | None = None
    """NXDI_KERNEL_DIR: where nxdi's CPU kernels are built and cached (default ~/.cache/nxdi/kernels)."""
    backend: str | None = None
    """NXDI_BACKEND: the backend models compile and run on (`cpu`, `xla`, `neuron`; default cpu)."""
    num_threads: int | None = None
    """NXDI_NUM_THREADS: torch intra-op threads of each tensor-parallel rank process (default: the
    driver's torch threads shared out among the ranks)."""
    rank_timeout: int | None = None
    """NXDI_RANK_TIMEOUT: seconds a rank may take for one step before it is declared hung."""
    host_collectives_kib: int | None = None
    """NXDI_HOST_COLLECTIVES_KIB: the shared-memory slot of rank processes' collectives, in KiB
    (0: gloo only); larger tensors go through gloo."""
    lock_timeout: float | None = None
    """NXDI_LOCK_TIMEOUT: seconds compile() and load() wait for another process that holds the
    compiled-model folder (compiling, or loading while this one compiles); 0 fails at once with
    FolderLockedError naming the holder; unset: wait as long as it takes."""
    allow_nonfinite_weights: bool = False
    """NXDI_ALLOW_NONFINITE_WEIGHTS (1/true/yes, or 0/false/no): accept checkpoints holding NaN or
    inf weights, which compile() and to_cpu() otherwise refuse, naming each tensor."""
    torchrun: Torchrun | None = None
    """Set when torchrun (or another launcher) started this process as one rank (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR and MASTER_PORT all set)."""
    neuron_nodes: NeuronNodes | None = None
    """Set when NEURON_RT_ROOT_COMM_ID, NEURON_RANK_ID and NEURON_LOCAL_TP are all set."""
    pp_stages: int | None = None
    """NEURON_PP_STAGES: pipeline stages over nodes (nxdi splits models by tensor parallelism only)."""
    problems: tuple[str, ...] = ()
    """Variables that were set but could not be understood (the shell warns)."""


def child_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of a process nxdi starts: this process's, with `extra` set on top."""
    return {**os.environ, **extra}


def _int(environ: Mapping[str, str], name: str, problems: list[str]) -> int | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        problems.append(f"{name}={raw!r} is not an integer; ignored")
        return None


def _seconds(environ: Mapping[str, str], name: str, problems: list[str]) -> float | None:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # negative, or nan
        problems.append(f"{name}={raw!r} is not a number of seconds >= 0; ignored")
        return None
    return value


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _flag(environ: Mapping[str, str], name: str, problems: list[str]) -> bool:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return False
    value = raw.strip().lower()
    if value not in _TRUE | _FALSE:
        # Not read as "on": an opt-in out of a safety check must be unambiguous.
        problems.append(f"{name}={raw!r} is not one of 1, true, yes, on, 0, false, no, off; read as off")
    return value in _TRUE


def _torchrun(environ: Mapping[str, str], problems: list[str]) -> Torchrun | None:
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(environ.get(n) for n in names):
        return None
    rank, world, port = (_int(environ, n, problems) for n in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
    local = _int(environ, "LOCAL_RANK", problems)
    if rank is None or world is None or port is None:
        return None
    return Torchrun(
        rank=rank,
        world_size=world,
        local_rank=rank if local is None else local,
        master_addr=environ["MASTER_ADDR"],
        master_port=port,
    )


_OFF = frozenset({"0", "off", "false", "no", "none"})


def compile_cache(env: Mapping[str, str], problems: list[str]) -> str | None:
    """The persistent compile cache's folder, or None when it is turned off. It is on by default,
    as the Neuron persistent cache is; the first of these that is set decides:

    - `NXDI_COMPILE_CACHE`: a folder, or 0/off/false/no/none (or empty) to turn it off;
    - `NEURON_COMPILE_CACHE_URL`: a local folder (or `file://` URL); a remote URL (`s3://...`)
      cannot hold nxdi's cache, which then stays at its default (said in `problems`);
    - `NEURON_CC_FLAGS` holding `--cache_dir=DIR` (or `--cache_dir DIR`), or `--no_cache` (off);
    - default: `$XDG_CACHE_HOME/nxdi/compile-cache`, else `~/.cache/nxdi/compile-cache`.
    """
    own = env.get("NXDI_COMPILE_CACHE")
    if own is not None:
        return None if own.strip().lower() in _OFF or not own.strip() else own
    url = env.get("NEURON_COMPILE_CACHE_URL", "").strip()
    if url.startswith("file://"):
        return url.removeprefix("file://")
    if url and "://" in url:
        problems.append(
            f"NEURON_COMPILE_CACHE_URL={url!r}: nxdi caches compiled programs in a local folder only, so it uses its "
            "default; set NXDI_COMPILE_CACHE=DIR to choose one, or NXDI_COMPILE_CACHE=off"
        )
    elif url:
        return url
    try:
        flags = shlex.split(env.get("NEURON_CC_FLAGS", ""))
    except ValueError:
        flags = []
        problems.append(f"NEURON_CC_FLAGS={env.get('NEURON_CC_FLAGS')!r} cannot be split into flags; ignored")
    for i, flag in enumerate(flags):
        if flag in ("--no_cache", "--no-cache"):
            return None
        if flag.startswith("--cache_dir="):
            return flag.removeprefix("--cache_dir=")
        if flag == "--cache_dir" and i + 1 < len(flags):
            return flags[i + 1]
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nxdi", "compile-cache")


def _neuron_nodes(environ: Mapping[str, str], problems: list[str]) -> NeuronNodes | None:
    names = ("NEURON_RT_ROOT_COMM_ID", "NEURON_RANK_ID", "NEURON_LOCAL_TP")
    given = [n for n in names if environ.get(n)]
    if not given:
        return None
    if len(given) < len(names):
        missing = [n for n in names if n not in given]
        problems.append(
            f"{', '.join(given)} set without {', '.join(missing)}: multi-node tensor parallelism needs all three; ignored"
        )
        return None
    addr, _, port = environ["NEURON_RT_ROOT_COMM_ID"].strip().rpartition(":")
    node, local = _int(environ, "NEURON_RANK_ID", problems), _int(environ, "NEURON_LOCAL_TP", problems)
    if not addr or not port.isdigit():
        problems.append(
            f"NEURON_RT_ROOT_COMM_ID={environ['NEURON_RT_ROOT_COMM_ID']!r} is not <address>:<port>; ignored"
        )
        return None
    if node is None or local is None or node < 0 or local < 1:
        if node is not None and local is not None:
            problems.append(
                f"NEURON_RANK_ID={node} / NEURON_LOCAL_TP={local}: need a rank >= 0 and a local tp >= 1; ignored"
            )
        return None
    return NeuronNodes(root_addr=addr, root_port=int(port), node_rank=node, local_tp=local)


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
            problems.append(
                f"NEURON_PLATFORM_TARGET_OVERRIDE={target_raw!r} is not one of {', '.join(p.value for p in Platform)}; ignored"
            )
    return Env(
        torchrun=_torchrun(env, problems),
        rank_timeout=_int(env, "NXDI_RANK_TIMEOUT", problems),
        host_collectives_kib=_int(env, "NXDI_HOST_COLLECTIVES_KIB", problems),
        logical_nc_config=_int(env, "NEURON_LOGICAL_NC_CONFIG", problems),
        platform_target=target,
        rt_visible_cores=env.get("NEURON_RT_VISIBLE_CORES"),
        compile_cache_dir=compile_cache(env, problems),
        kernel_dir=env.get("NXDI_KERNEL_DIR") or None,
        backend=env.get("NXDI_BACKEND") or None,
        num_threads=_int(env, "NXDI_NUM_THREADS", problems),
        allow_nonfinite_weights=_flag(env, "NXDI_ALLOW_NONFINITE_WEIGHTS", problems),
        lock_timeout=_seconds(env, "NXDI_LOCK_TIMEOUT", problems),
        neuron_nodes=_neuron_nodes(env, problems),
        pp_stages=_int(env, "NEURON_PP_STAGES", problems),
        problems=tuple(problems),
    )


@contextlib.contextmanager
def path_prepended(directory: str | os.PathLike[str]) -> Iterator[None]:
    """PATH with `directory` first while the block runs (tools installed beside the interpreter,
    such as the `ninja` kernel builds need, are then found without an activated venv)."""
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(directory), before])
    try:
        yield
    finally:
        os.environ["PATH"] = before
