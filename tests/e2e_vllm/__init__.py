"""End-to-end tests against real vLLM servers on CPU (marker ``vllm_e2e``; docs/contributing/tests.md).

The harness (``cluster``: start/stop/status, ``provision``: venv and tiny models) is plain Python
and synchronous, so it serves a pytest session fixture and the command line alike; the two
scripts ``vllm_cli.py`` and ``make_tiny_model.py`` run inside the vLLM venv, not this one.
"""
