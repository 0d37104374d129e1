"""Ask Linux for AMX in this process: copied into the vLLM venv's site-packages by epd-trio's
real-vLLM harness (``tests/e2e_vllm/amx.py``, issue 30), imported by ``epd_trio_amx.pth``
at every start of that venv's Python, vLLM's spawned engine process included.

Why: on an x86-64 CPU with AMX (``amx_tile`` in /proc/cpuinfo), Linux lets a process use AMX
tile data only after ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``. vLLM's CPU
attention runs AMX instructions (bf16, block size a multiple of 32) without asking; a process
whose first forward is one token dies of SIGILL. Elsewhere the call fails (no AMX: EINVAL or
EOPNOTSUPP) and changes nothing; on other architectures it is not made. With
``EPD_E2E_AMX_PERMISSION=0`` in the environment it is not made either: that reproduces the bug
on an AMX CPU (docs/contributing/nixl-first-pull.md).

Standard library only, and nothing here may raise: it runs before every program of the venv.
"""

import os

#: arch_prctl's number on x86-64, and its option asking for an extended state component.
SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023
#: The AMX tile data state component (the only one ARCH_REQ_XCOMP_PERM grants).
XFEATURE_XTILEDATA = 18

#: The process that asked (a forked child inherits the permission and this module's state).
pid = os.getpid()
#: The call's result: 0 granted, -1 refused (``errno`` says why); None: not made (not x86-64,
#: or switched off).
result = None
errno = 0

if os.uname().machine == "x86_64" and os.environ.get("EPD_E2E_AMX_PERMISSION") != "0":
    try:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
        result = _libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
        errno = ctypes.get_errno()
    except Exception:  # never break the interpreter's start
        result = -1

# Where the harness wants each process's outcome, to check that a server's spawned engine asked
# too: a file named by the pid, holding "result errno".
_record = os.environ.get("EPD_E2E_AMX_RECORD")
if _record:
    try:
        with open(os.path.join(_record, str(pid)), "w") as _file:
            _file.write(f"{result} {errno}\n")
    except OSError:
        pass
