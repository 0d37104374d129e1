"""Benchmarks for epd_trio (run as ``python -m bench.<name>``); they measure, tests never time."""
