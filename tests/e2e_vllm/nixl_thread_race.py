"""Stress one NIXL agent from two threads the way vLLM 0.32's NixlConnector does on a first pull.

    python nixl_thread_race.py default|strict SECONDS     # with the vLLM venv's Python

vLLM runs a decode's first hand-shake with a prefill in a background thread (``add_remote_agent``,
``prep_xfer_dlist``) while the engine thread keeps polling the same agent (``get_new_notifs``)
every step; it creates the agent without a ``sync_mode``, and NIXL 1.5.1 then picks
``NIXL_THREAD_SYNC_NONE`` (no listener thread). Here a producer agent in a child process
registers memory; the consumer agent's second thread adds it, prepares its descriptors, reads
two blocks and removes it, over and over, while the main thread polls notifications. ``strict``
passes ``NIXL_THREAD_SYNC_STRICT`` instead. Prints the rounds survived (a crash ends the process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

BLOCKS, BLOCK_LEN = 512, 4096


def config(mode: str) -> nixl_agent_config:
    sync = {"default": None, "strict": nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT}[mode]
    return nixl_agent_config(num_threads=4, capture_telemetry=True, sync_mode=sync)  # as vLLM


def descs(base: int) -> np.ndarray:
    return np.array([(base + i * BLOCK_LEN, BLOCK_LEN, 0) for i in range(BLOCKS)], dtype=np.uint64)


def producer(path: str) -> None:
    agent = nixl_agent(f"P{os.getpid()}", config("default"))
    memory = torch.ones(BLOCKS * BLOCK_LEN, dtype=torch.uint8)
    agent.register_memory(memory)
    Path(path + ".part").write_bytes(memory.data_ptr().to_bytes(8, "little")
                                     + agent.get_agent_metadata())
    os.rename(path + ".part", path)
    sys.stdin.read()  # serve reads until the consumer closes our stdin


def consumer(mode: str, seconds: float) -> None:
    path = os.path.join(tempfile.mkdtemp(), "producer.meta")
    child = subprocess.Popen([sys.executable, __file__, "producer", path], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not os.path.exists(path):
        if child.poll() is not None:
            raise SystemExit("the producer exited")
        time.sleep(0.1)
    raw = Path(path).read_bytes()
    remote_base, metadata = int.from_bytes(raw[:8], "little"), raw[8:]
    agent = nixl_agent("D", config(mode))
    memory = torch.zeros(BLOCKS * BLOCK_LEN, dtype=torch.uint8)
    agent.register_memory(memory)
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(descs(memory.data_ptr()), "DRAM"))
    stop, rounds, polls = threading.Event(), [0], [0]

    def handshakes() -> None:
        while not stop.is_set():
            name = agent.add_remote_agent(metadata)
            remote = agent.prep_xfer_dlist(name, agent.get_xfer_descs(descs(remote_base), "DRAM"))
            xfer = agent.make_prepped_xfer("READ", local, [0, 1], remote, [0, 1], b"done")
            agent.transfer(xfer)
            while agent.check_xfer_state(xfer) == "PROC":
                pass
            agent.release_xfer_handle(xfer)
            agent.release_dlist_handle(remote)
            agent.remove_remote_agent(name)
            rounds[0] += 1

    thread = threading.Thread(target=handshakes)
    thread.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        agent.get_new_notifs()
        polls[0] += 1
    stop.set()
    thread.join()
    assert int(memory[0]) == 1  # the reads landed
    print(f"{mode}: survived {seconds:g} s: {rounds[0]} hand-shakes with a read, "
          f"{polls[0]} polls on the other thread", flush=True)
    child.stdin.close()
    child.wait()


if __name__ == "__main__":
    if sys.argv[1] == "producer":
        producer(sys.argv[2])
    else:
        consumer(sys.argv[1], float(sys.argv[2]))
