"""The instructions a peer's process executes during the measured load, counted by callgrind.

Why: a proxy's CPU time per request moves 10 to 40 % from round to round on a shared 2-core
machine, so a difference of 3 % (issue 41's bar for routing by model) cannot be resolved from
it in any number of rounds this machine has time for. The instructions a process executes for
the same requests are nearly deterministic: repeated runs of one peer agree within about 1 %.

How: the peer runs under ``valgrind --tool=callgrind --instr-atstart=no`` (its start-up and
warm-up run uninstrumented, so they cost seconds, not minutes); after the warm-up the count is
switched on and zeroed, and after the load it is dumped and read. Instrumented, the process runs
tens of times slower: a run measures instructions, not time, and a small ``--requests`` does.
Only a peer whose process is the server itself can be counted (``epd_trio`` with one worker).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import trio

#: A counted peer's background work put off past the run: under callgrind a load lasts tens
#: of times longer, and the health probes and ``/v1/models`` rounds of its window, work per
#: second and per instance, would be counted as the requests' (three pools have two instances
#: more to probe: 0.3 million instructions a second, 1 % of a request at C=1, all background).
QUIET = {"EPD_HEALTH_INTERVAL": "3600", "EPD_MODELS_INTERVAL": "3600"}

#: The command that starts a peer under callgrind, counting nothing until told.
VALGRIND = ("valgrind", "--tool=callgrind", "--instr-atstart=no")


def available() -> str | None:
    """Why instructions cannot be counted here (None: they can)."""
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not found (apt-get install valgrind)" if missing else None


def wrapped(command: list[str], out_dir: Path) -> list[str]:
    """``command`` under callgrind, its dumps written in ``out_dir`` (named by the pid)."""
    return [*VALGRIND, f"--callgrind-out-file={out_dir / 'callgrind.%p'}", *command]


def total(dump: str) -> int:
    """The instructions a callgrind dump counted (its ``summary:`` line, else ``totals:``)."""
    found: dict[str, int] = {}
    for line in dump.splitlines():
        key, _, value = line.partition(":")
        if key in ("summary", "totals") and value.split():
            found[key] = int(value.split()[0])
    if not found:
        raise ValueError("not a callgrind dump: no summary or totals line")
    return found.get("summary", found.get("totals", 0))


async def _control(*args: str) -> None:
    await trio.run_process(["callgrind_control", *args], capture_stdout=True,
                           capture_stderr=True)


async def start(pid: int) -> None:
    """Count from now: instrumentation on, counters at zero."""
    await _control("--instr=on", str(pid))
    await _control("--zero", str(pid))


async def read(pid: int, out_dir: Path) -> int:
    """The instructions counted since ``start``: dumped now, read from the dump."""
    dumps = trio.Path(out_dir)
    before = set(await dumps.glob(f"callgrind.{pid}.*"))
    await _control("--dump", str(pid))
    (dump,) = set(await dumps.glob(f"callgrind.{pid}.*")) - before
    return total(await dump.read_text(errors="replace"))
