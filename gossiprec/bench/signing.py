"""``python -m gossiprec.bench.signing``: what per-member signatures cost.

Theory of operation
-------------------
``cost``: CPU microseconds (``process_time``) per signature made and per signature checked, for the
agents' Ed25519 keys and for the simulator's keyed-hash stand-in, over a typical signed message (an
alert), ``count`` of each; and per check served from the key book's cache (a gossiped copy of an item
already verified). ``sim``: the agreement simulator (a one-node crash at ``nodes`` members) run with
each signing mode, events processed per wall second; with ``--no-sim`` it is skipped. Compare builds
by running this module's ``sim`` part under each tree (``PYTHONPATH=TREE``), or the simulator's own
summary, in the same session. The output is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from gossiprec.core.auth import DigestCrypto, KeyBook
from gossiprec.core.wire import UNREACHABLE, Alert
from gossiprec.security.signing import Ed25519Crypto


def _per_call_us(fn: Any, count: int) -> float:
    t = time.process_time()
    for _ in range(count):
        fn()
    return round((time.process_time() - t) / count * 1e6, 2)


def _scheme_cost(crypto: Any, other: Any, count: int) -> dict[str, float]:
    book = KeyBook("n1", crypto)
    alerts = [Alert(7, "0123456789abcdef", "n1", f"n{i}", 0, UNREACHABLE, False, "", "", "") for i in range(count)]
    it = iter(alerts)
    sign_us = _per_call_us(lambda: book.sign(next(it)), count)
    reader = KeyBook("n2", other)
    reader.bind("n1", crypto.public_key)
    it = iter(alerts)
    verify_us = _per_call_us(lambda: reader.check("n1", next(it)), count)
    cached_us = _per_call_us(lambda: reader.check("n1", alerts[0]), count)
    assert all(reader.check("n1", a) for a in alerts[:10])
    return {"sign_us": sign_us, "verify_us": verify_us, "verify_cached_us": cached_us}


def measure_cost(count: int) -> dict[str, Any]:
    return {
        "ed25519": _scheme_cost(Ed25519Crypto.generate(), Ed25519Crypto.generate(), count),
        "digest": _scheme_cost(DigestCrypto.for_name("n1"), DigestCrypto.for_name("n2"), count),
    }


def measure_sim(nodes: int, seeds: int, modes: list[str]) -> dict[str, Any]:
    """Events per CPU second of the simulator per signing mode; the modes alternate seed by seed, so a
    machine whose load drifts during the run weighs on each alike."""
    from gossiprec.sim.agree import AgreeParams, run_agreement

    acc = {mode: {"events": 0, "wall_s": 0.0, "cpu_s": 0.0} for mode in modes}
    for seed in range(1, seeds + 1):
        for mode in modes:
            r = run_agreement(AgreeParams(scenario="crash", nodes=nodes, seed=seed, duration=10.0, signing=mode))
            a = acc[mode]
            a["events"] += r["events"]
            a["wall_s"] += r["wall_s"]
            a["cpu_s"] += r["cpu_s"]
    out: dict[str, Any] = {}
    for mode, a in acc.items():
        out[mode] = {"events": a["events"], "wall_s": round(a["wall_s"], 3), "cpu_s": round(a["cpu_s"], 3),
                     "events_per_wall_s": round(a["events"] / a["wall_s"]),
                     "events_per_cpu_s": round(a["events"] / max(a["cpu_s"], 1e-9))}
    base = out.get(modes[0])
    if base is not None:
        for mode in modes[1:]:  # the first mode (default: none) is the baseline
            ratio = base["events_per_cpu_s"] / out[mode]["events_per_cpu_s"]
            out[mode]["cpu_per_event_vs_" + modes[0]] = round(ratio, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gossiprec.bench.signing", description=__doc__.split("\n")[0])
    p.add_argument("--count", type=int, default=2000, help="signatures made and checked per scheme")
    p.add_argument("--nodes", type=int, default=64, help="simulated members")
    p.add_argument("--seeds", type=int, default=2, help="simulator runs per mode")
    p.add_argument("--modes", default="none,digest,ed25519", help="simulator signing modes")
    p.add_argument("--no-sim", dest="sim", action="store_false")
    args = p.parse_args(argv)
    doc: dict[str, Any] = {"cost": measure_cost(args.count)}
    if args.sim:
        doc["sim"] = measure_sim(args.nodes, args.seeds, args.modes.split(","))
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
