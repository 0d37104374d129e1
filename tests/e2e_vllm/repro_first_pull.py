"""Decode's first KV pull without any proxy: start a NIXL prefill and decode, send prefill then
decode by hand. On a CPU with AMX and a venv that does not ask for AMX in every process, decode's
engine dies of SIGILL at the one-token step after the pull (issue 30; with the harness's venv,
set EPD_E2E_AMX_PERMISSION=0; docs/contributing/nixl-first-pull.md).

    python repro_first_pull.py MODEL_DIR [--vllm CMD] [--max-model-len N] [--words N] ...

Run it with the Python of a venv that has vLLM and NIXL (it uses only the standard library).
Each run starts a fresh P (kv_producer) and D (kv_consumer) on free ports, so the request it
sends is the cluster's first; it prints both answers and decode's log tail, and exits 0 when
decode answered 200, 1 when it did not, and stops both servers either way.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, str]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, f"{type(exc).__name__}: {exc}"


def wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: server exited during start-up")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url}: not healthy after {timeout:g} s")


def rss_mib(pid: int) -> int:
    """The resident memory of a process and its children (the engine core is a child)."""
    pids, total = [pid], 0
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        pids.append(int(child))
    for p in pids:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total // 1024


def one_request(prefill: str, decode: str, body: dict, index: int) -> int:
    """Prefill (keep the KV for a remote decode), then decode with the handle it returned."""
    body = {**body, "messages": [{"role": "user", "content": f"{index} {body['messages'][0]['content']}"}]}
    handle = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
    status, text = post(prefill + "/v1/chat/completions",
                        {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": handle})
    if status != 200:
        print(f"[{index}] prefill: {status} {text[:200]}")
        return status
    answer = json.loads(text)
    params = answer["kv_transfer_params"]
    print(f"[{index}] prefill: {answer['usage']['prompt_tokens']} prompt tokens, "
          f"kv_transfer_params {json.dumps(params)}")
    status, text = post(decode + "/v1/chat/completions",
                        {**body, "max_tokens": 16, "kv_transfer_params": params})
    print(f"[{index}] decode: {status} {text[:300]}")
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--vllm", default="vllm", help="the vllm command (default: vllm)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--words", type=int, default=3, help="words of the text prompt")
    parser.add_argument("--kv-extra", default="{}", help="kv_connector_extra_config JSON")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="one more `vllm serve` argument for both servers (repeatable)")
    parser.add_argument("--warm-decode", action="store_true",
                        help="send decode one plain request (no KV pull) before the pull")
    parser.add_argument("--concurrent", type=int, default=1,
                        help="requests sent at once (each prefill, then its decode)")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="nixl-first-pull-"))
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    servers: dict[str, tuple[str, subprocess.Popen, Path]] = {}
    try:
        for role in ("producer", "consumer"):
            port, nixl_port = free_port(), free_port()
            kv = {"kv_connector": "NixlConnector", "kv_role": f"kv_{role}",
                  "kv_buffer_device": "cpu",
                  "kv_connector_extra_config": json.loads(args.kv_extra)}
            cmd = [*shlex.split(args.vllm), "serve", args.model, "--host", "127.0.0.1",
                   "--port", str(port), "--served-model-name", "tiny", "--max-model-len",
                   str(args.max_model_len), "--dtype", "bfloat16", "--max-num-seqs", "8",
                   "--enforce-eager", "--distributed-executor-backend", "uni",
                   "--kv-transfer-config", json.dumps(kv), *args.serve_arg]
            log = home / f"{role}.log"
            (home / role).mkdir()
            with open(log, "wb") as out:
                process = subprocess.Popen(
                    cmd, stdout=out, stderr=out, start_new_session=True,
                    env={**env, "TMPDIR": str(home / role),
                         "VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_port)})
            servers[role] = (f"http://127.0.0.1:{port}", process, log)
            print(f"$ {shlex.join(cmd)}", flush=True)
        for url, process, _ in servers.values():
            wait_healthy(url, process, args.timeout)
        prefill, decode = servers["producer"][0], servers["consumer"][0]
        body = {"model": "tiny", "temperature": 0,
                "messages": [{"role": "user", "content": " ".join(["hello"] * args.words)}]}
        if args.warm_decode:
            status, _ = post(decode + "/v1/chat/completions", {**body, "max_tokens": 2})
            print(f"decode warm-up (no KV pull): {status}")
        print(f"decode RSS before the first pull: {rss_mib(servers['consumer'][1].pid)} MiB")
        with ThreadPoolExecutor(args.concurrent) as pool:
            results = list(pool.map(lambda i: one_request(prefill, decode, body, i),
                                    range(args.concurrent)))
        print(f"decode RSS after: {rss_mib(servers['consumer'][1].pid)} MiB")
        time.sleep(2)  # let decode's log show what followed
        tail = servers["consumer"][2].read_text(errors="replace").splitlines()[-15:]
        print("--- decode log, last 15 lines:\n" + "\n".join(tail))
        return 0 if all(r == 200 for r in results) else 1
    finally:
        for _, process, _ in servers.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for _, process, _ in servers.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        print(f"logs in {home}")


if __name__ == "__main__":
    sys.exit(main())
