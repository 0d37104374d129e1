#!/bin/sh
# Install the optional reference proxies for `python -m bench.compare` into ~/.cache/epd-refs,
# each in a venv of its own (never a dependency of epd_trio, never in CI):
#   - vllm-router (PyPI; a Rust router with a Python launcher)
#   - a Python with the dependencies of vLLM's disagg_epd_proxy.py (fastapi, uvicorn, uvloop,
#     httptools, aiohttp, msgspec). The proxy file itself is vLLM's code: fetch it yourself from
#     https://github.com/vllm-project/vllm/blob/main/examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py
#     into ~/.cache/epd-refs/disagg_epd_proxy.py (or point --epd-proxy / EPD_BENCH_EPD_PROXY at it).
#   - the OpenAI SDK (PyPI `openai`), the load of `bench.compare --client openai`
#   The EPD proxy's venv (it has aiohttp) also runs `bench.compare --client aiohttp`, and the
#   aiohttp fakes of `--fake aiohttp` / `--lab` (bench/aiohttp_fake.py).
# Usage: sh bench/install_references.sh   (PYTHON=python3.12 to pick the interpreter)
set -eu
PYTHON=${PYTHON:-python3}
REFS=${EPD_REFS:-$HOME/.cache/epd-refs}
mkdir -p "$REFS"
if [ ! -x "$REFS/vllm-router-venv/bin/vllm-router" ]; then
    "$PYTHON" -m venv "$REFS/vllm-router-venv"
    "$REFS/vllm-router-venv/bin/pip" install -q vllm-router
fi
if [ ! -x "$REFS/epd-proxy-venv/bin/python" ] || \
        ! "$REFS/epd-proxy-venv/bin/python" -c "import fastapi, uvicorn, uvloop, aiohttp, msgspec" 2>/dev/null; then
    "$PYTHON" -m venv "$REFS/epd-proxy-venv"
    "$REFS/epd-proxy-venv/bin/pip" install -q fastapi uvicorn uvloop httptools aiohttp msgspec
fi
"$REFS/vllm-router-venv/bin/pip" show vllm-router | grep -i '^version' | sed 's/^/vllm-router /'
"$REFS/epd-proxy-venv/bin/pip" list 2>/dev/null | grep -iE '^(fastapi|uvicorn|uvloop|aiohttp|msgspec) '
# The OpenAI SDK, for `bench.compare --client openai` (the client most users run).
if [ ! -x "$REFS/openai-venv/bin/python" ] || \
        ! "$REFS/openai-venv/bin/python" -c "import openai" 2>/dev/null; then
    "$PYTHON" -m venv "$REFS/openai-venv"
    "$REFS/openai-venv/bin/pip" install -q openai
fi
"$REFS/openai-venv/bin/pip" list 2>/dev/null | grep -iE '^(openai|httpx) '
if [ -f "$REFS/disagg_epd_proxy.py" ]; then
    echo "EPD proxy: $REFS/disagg_epd_proxy.py"
else
    echo "EPD proxy: not found; download disagg_epd_proxy.py into $REFS (see the top of this script)"
fi
