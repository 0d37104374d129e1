"""What discovery costs: ``python -m bench.discovery_cost [--instances 64]``.

Two figures. (1) Applying one answer to the roster, as every DNS round and every Kubernetes
event does (``Membership.discovered``): an unchanged answer (the common case) is checked on the
process's own roster, without a lock; a changed one goes through the roster store, in one
process or through the shared memory of ``epd-trio serve --workers N``, where it runs under the
lock the routing counters also take (time other workers' requests may wait). (2) One DNS round
(A and AAAA, dnspython on trio) against a local dnsmasq, wall-clock and CPU, when dnsmasq is
installed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
import timeit
from pathlib import Path

import trio

from epd_trio._core.counters import CursorCounters
from epd_trio._core.discovery import Discovered, DnsView, parse_dns_url
from epd_trio._core.roster import Roster, replace_source
from epd_trio._core.routing import Instance
from epd_trio._state.roster_store import LocalRosterStore, SharedRoutingState


def apply_cost(instances: int, repeat: int) -> dict[str, float]:
    """Microseconds per apply, best of 5, for each store and answer."""
    same = [Discovered(Instance(f"http://10.0.{i // 250}.{i % 250}:8000", 8))
            for i in range(instances)]
    other = [*same[1:], Discovered(Instance("http://10.9.9.9:8000", 8))]
    results = {}
    zero = {"encode": 0, "prefill": 0, "decode": 0}
    roster, _ = replace_source(Roster(), "dns", "decode", same, zero)
    best = min(timeit.repeat(lambda: replace_source(roster, "dns", "decode", same, zero),
                             number=repeat, repeat=5)) / repeat
    results["unchanged, checked without the lock"] = best * 1e6
    for store_name in ("local", "shared"):
        store = (LocalRosterStore(CursorCounters.local()) if store_name == "local"
                 else SharedRoutingState())
        store.attach(Roster())
        store.update(lambda r, c: replace_source(r, "dns", "decode", same, c))
        for answer_name, answers in (("one replaced", (other, same)),):
            flip = iter(answers * (repeat * 5 + 1))

            def once(store=store, flip=flip) -> None:
                answer = next(flip)
                store.update(lambda r, c: replace_source(r, "dns", "decode", answer, c))

            best = min(timeit.repeat(once, number=repeat, repeat=5)) / repeat
            results[f"{answer_name}, {store_name} store"] = best * 1e6
    return results


def dns_round_cost(rounds: int) -> tuple[float, float] | None:
    """(wall ms, CPU ms) per round of A + AAAA against a dnsmasq on loopback; None without it."""
    binary = shutil.which("dnsmasq") or shutil.which("dnsmasq", path="/usr/sbin")
    if binary is None:
        return None
    from epd_trio._discovery.dns import DnsDiscovery

    with tempfile.TemporaryDirectory() as tmp:
        hosts = Path(tmp) / "hosts"
        hosts.write_text("".join(f"10.0.0.{i} vllm-decode.bench\n" for i in range(1, 9)))
        port = 25353
        process = subprocess.Popen(
            [binary, "--keep-in-foreground", "--conf-file=/dev/null", f"--port={port}",
             "--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv", "--no-hosts",
             f"--addn-hosts={hosts}", "--local=/bench/", "--cache-size=0", "--pid-file=",
             "--user=root", "--log-facility=/dev/null"])
        try:
            name = parse_dns_url("dns+http://vllm-decode.bench:8000")
            discovery = DnsDiscovery([("decode", name)], lambda s, r, i: ([], []),
                                     nameserver=f"127.0.0.1:{port}", interval=1, timeout=2)

            async def run() -> tuple[float, float]:
                for _ in range(50):  # until dnsmasq answers
                    await discovery._round("decode", name, lambda s, r, i: ([], []))
                    if discovery.views[name.spec].endpoints:
                        break
                    discovery.views[name.spec] = DnsView()
                    await trio.sleep(0.1)
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(rounds):
                    await discovery._round("decode", name, lambda s, r, i: ([], []))
                return ((time.perf_counter() - wall) / rounds * 1e3,
                        (time.process_time() - cpu) / rounds * 1e3)

            return trio.run(run)
        finally:
            process.terminate()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    for label, micros in apply_cost(args.instances, args.repeat).items():
        print(f"apply {args.instances} instances ({label}): {micros:.1f} us")
    dns = dns_round_cost(args.rounds)
    if dns is None:
        print("DNS round: dnsmasq not installed")
    else:
        print(f"DNS round (A + AAAA, 8 records): {dns[0]:.2f} ms wall, {dns[1]:.2f} ms CPU")


if __name__ == "__main__":
    main()
