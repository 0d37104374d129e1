"""AMX permission in every vLLM process the harness starts (issue 30), and naming a SIGILL death.

Which machines: x86-64 CPUs with AMX (``amx_tile`` among /proc/cpuinfo's flags: Intel Xeon
from the 4th generation, "Sapphire Rapids", on). Elsewhere nothing here changes anything.

Why: Linux lets a process use AMX tile data only after it asks, with
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``. vLLM's CPU attention picks its AMX
kernels for bf16 with a block size divisible by 32 (``_get_attn_isa`` in vLLM's ``cpu_attn.py``)
and runs them without asking. The only request in vLLM's ``_C`` is inside its bundled oneDNN,
which a prefill-sized forward happens to reach first. A process whose first forward is one
token (a decode step after a KV pull, or a one-token prompt) never asks, and dies of SIGILL at
its first ``tilezero``. The permission is per process and dropped at exec, and vLLM's engine
is a spawned interpreter, so the request must run in every interpreter of the venv. A ``.pth``
file in site-packages does that: ``site`` runs its ``import`` line at every start of that
Python, the spawned engine's included. (The harness strips ``PYTHON*`` variables from the
servers' environment, and the engine is not started by our code, so ``PYTHONPATH`` or a wrapper
would not reach it.)

What the harness does with it (``provision.ensure_venv``):
- its own venv: ``install`` writes ``epd_trio_amx_permission.py`` (this folder's copy) and
  ``epd_trio_amx.pth`` into site-packages, for a new venv and for one already stamped, then
  ``problem`` checks, in a child spawned the way vLLM spawns its engine, that the line ran.
- a user's venv (``EPD_E2E_VENV``, never modified): checked, not written. On a CPU with AMX a
  spawned child without the permission is refused, with the two files to add: the suite would
  otherwise fail 13 of its 15 tests with vLLM's "EngineCore encountered an issue". Without AMX
  the venv is used as it is; a warning says that it would not do on an AMX CPU, unless some
  ``.pth`` file in it already makes the request (``../shared/vllm-cpu/setup.sh`` writes one).

``EPD_E2E_AMX_PERMISSION=0`` switches the request off (the module skips it, the check is not
made): on an AMX CPU the suite's first two tests (``conftest.FIRST``) then show the bug. The fix
belongs in vLLM's CPU worker (docs/contributing/nixl-first-pull.md has the report).

Run by the vLLM venv's Python (standard library only, like ``vllm_cli.py``), ``python amx.py``
prints as JSON what this interpreter and a child spawned as vLLM spawns its engine got.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: The module the ``.pth`` line imports, copied as it is into the venv's site-packages.
MODULE = "epd_trio_amx_permission"
MODULE_SOURCE = HERE / f"{MODULE}.py"
PTH_NAME = "epd_trio_amx.pth"
PTH_LINE = f"import {MODULE}\n"
#: arch_prctl (x86-64): its number, the option that reads the granted components, and the bit
#: of AMX tile data (XFEATURE_XTILEDATA) in what it returns.
SYS_ARCH_PRCTL = 158
ARCH_GET_XCOMP_PERM = 0x1022
XTILEDATA_BIT = 1 << 18
#: ``0``: no process of the venv asks (to reproduce the bug on an AMX CPU).
SWITCH = "EPD_E2E_AMX_PERMISSION"
#: A folder where each process of the venv records what it got (a file per pid): every server
#: has one, so a test can check that its spawned engine asked (``records``).
RECORD = "EPD_E2E_AMX_RECORD"
#: What faulthandler (``PYTHONFAULTHANDLER=1`` in every server's environment) writes before a
#: process dies of a fatal signal; vLLM itself only logs that its engine "exited unexpectedly".
FATAL_ERRORS = {"Illegal instruction": "SIGILL", "Segmentation fault": "SIGSEGV",
                "Aborted": "SIGABRT", "Bus error": "SIGBUS", "Floating-point exception": "SIGFPE"}
FATAL_LINE = re.compile(r"^Fatal Python error: (" + "|".join(FATAL_ERRORS) + ")", re.MULTILINE)
ENGINE_EXITED = "engine core exited unexpectedly"


def switched_off() -> bool:
    return os.environ.get(SWITCH) == "0"


def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """The CPU has AMX tiles (and the kernel knows it): ``amx_tile`` among its flags."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "amx_tile" in line.split() for line in text.splitlines())


def install(site: Path) -> list[Path]:
    """Write the module and the ``.pth`` line into ``site`` (left alone when already there);
    the files written."""
    written = []
    for path, content in ((site / f"{MODULE}.py", MODULE_SOURCE.read_text()),
                          (site / PTH_NAME, PTH_LINE)):
        try:
            if path.read_text() == content:
                continue
        except OSError:
            pass
        path.write_text(content)
        written.append(path)
    return written


def asks_elsewhere(site: Path) -> bool:
    """Some ``.pth`` file in ``site`` makes the request (ours, or another one-liner with the
    ARCH_REQ_XCOMP_PERM option, like the shared setup.sh's)."""
    return any(MODULE in text or "0x1023" in text
               for text in (p.read_text(errors="replace") for p in site.glob("*.pth")))


def records(folder: Path) -> dict[int, tuple[int | None, int]]:
    """What each process that recorded in ``folder`` got: pid -> (result, errno)."""
    found: dict[int, tuple[int | None, int]] = {}
    for path in folder.glob("[0-9]*"):
        result, errno = path.read_text().split()
        found[int(path.name)] = (None if result == "None" else int(result), int(errno))
    return found


def report(python: Path, env: dict[str, str]) -> dict[str, dict[str, object]]:
    """What ``python`` (a venv's) and a child it spawns got: ``state()`` of each, by name."""
    done = subprocess.run([str(python), str(Path(__file__))], capture_output=True, text=True,
                          env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{python} {Path(__file__).name} exited {done.returncode}:\n"
                           f"{done.stdout}{done.stderr}")
    return json.loads(done.stdout)


def problem(seen: dict[str, dict[str, object]], *, has_amx: bool, ours: bool) -> str | None:
    """What is wrong with a ``report``: None when every process vLLM would start is fine.

    ``ours``: our module must have run in each process (the venv is the harness's own).
    With AMX, each process must hold the permission, however it got it.
    """
    for role, state in seen.items():
        if ours and not state["ran"]:
            return f"the {role} process did not import {MODULE} ({PTH_NAME} not run)"
        if has_amx and not state["permitted"]:
            return (f"the {role} process has no AMX permission (arch_prctl ARCH_GET_XCOMP_PERM "
                    f"lacks XTILEDATA; {MODULE}: result {state['result']}, errno "
                    f"{state['errno']})")
    return None


def how_to_add(site: Path) -> str:
    return (f"add the permission request to its site-packages ({site}): copy {MODULE_SOURCE} "
            f"there, and write a file {PTH_NAME} there holding the line {PTH_LINE.strip()!r}")


def fatal_signal(log_text: str) -> str | None:
    """The fatal signal a process of a server died of, from faulthandler's line in its log."""
    found = FATAL_LINE.findall(log_text)
    return FATAL_ERRORS[found[-1]] if found else None


def death_message(name: str, log: Path, returncode: int | None = None,
                  *, has_amx: bool | None = None) -> str:
    """Why server ``name`` is gone, as far as its log (and its exit status, when it was our
    child) tell; a SIGILL names the missing AMX permission."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        text = ""
    died_of = fatal_signal(text)
    if died_of is None and returncode is not None and returncode < 0:
        died_of = signal.Signals(-returncode).name
    engine = ENGINE_EXITED in text
    if died_of is None:
        return (f"{name} is gone" + (": vLLM logged that its engine core exited unexpectedly"
                                     if engine else "")
                + f", without a fatal-signal report (log: {log})")
    if died_of != "SIGILL":
        return f"{name}: a vLLM process died of {died_of} (faulthandler's report in {log})"
    amx = cpu_has_amx() if has_amx is None else has_amx
    return (f"{name}: a vLLM process died of SIGILL (illegal instruction; faulthandler's report "
            f"in {log}). " + (
                "This CPU has AMX (amx_tile): the process lacked the AMX permission Linux "
                "wants first, arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), which "
                f"{PTH_NAME} in the vLLM venv requests in every process (tests/e2e_vllm/amx.py"
                ", docs/contributing/nixl-first-pull.md)" if amx else
                "This CPU has no AMX (no amx_tile), so not the missing AMX permission: an "
                "instruction this CPU lacks (a vLLM build for another CPU?)"))


# -- run by the vLLM venv's Python ----------------------------------------------------------------
def state() -> dict[str, object]:
    """This process: did our module run in it, what it got, and what Linux grants now."""
    module = sys.modules.get(MODULE)
    permitted = False
    if os.uname().machine == "x86_64":
        import ctypes

        mask = ctypes.c_uint64(0)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0:
            permitted = bool(mask.value & XTILEDATA_BIT)
    return {"pid": os.getpid(), "ran": module is not None and module.pid == os.getpid(),
            "result": getattr(module, "result", None), "errno": getattr(module, "errno", None),
            "permitted": permitted}


def main() -> None:
    # vLLM starts its engine with multiprocessing's spawn: a new interpreter of the same venv.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        spawned = pool.apply(state)
    print(json.dumps({"parent": state(), "spawned": spawned}))


if __name__ == "__main__":
    main()
