"""The bootstrap's signatures, on the virtual clock: a holder of the cluster key cannot decide view 0 with
forged seed answers or a bare ``BootDecided``, nor speak in another candidate's name; an honest bootstrap
still decides one view 0, whose members' keys the nodes built from it hold bound from the start.

Each attack here succeeded against the build before (unsigned bootstrap messages: forged accepteds
decided, forged promises made the proposer propose the forger's value, a ``BootDecided`` alone decided,
the first row seen for a name was kept, an accept from any candidate was accepted); there was no
``--public-keys``."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

import pytest

from gossiprec.agent.jobspec import boot_factory
from gossiprec.agent.settings import load_settings
from gossiprec.core.auth import DigestCrypto, KeyBook, signed_bytes
from gossiprec.core.bootstrap import BootParams, Booting, Bootstrap, Candidate, _rows, boot_keys, value_digest
from gossiprec.core.config import Config
from gossiprec.core.events import BootMismatch
from gossiprec.core.node import Node
from gossiprec.core.wire import (
    BootAccept, BootAccepted, BootDecided, BootHello, BootKnown, BootPrepare, BootPromise, Message, decode_packet,
    encode_packet,
)
from gossiprec.errors import ConfigError
from gossiprec.security.signing import load_signing_key

SEEDS = tuple(f"seed-{i}:7980" for i in range(3))
"""Seeds named by host names, the candidates advertising IP addresses (as agents do by default)."""
FORGER = DigestCrypto.for_name("forger")


def wire(msg: Message) -> Message:
    return decode_packet(encode_packet([msg]), 1 << 24)[0]


class Net:
    """Bootstraps of ``n`` candidates (the first three are the seeds), delivering through the codec.
    ``drop(src, dst, msg)``: True to lose a message (the hook may deliver forgeries instead)."""

    def __init__(self, n: int = 4, signed: bool = True, pins: dict[str, bytes] | None = None) -> None:
        self.params = BootParams(n, 0, SEEDS)
        self.boots: dict[str, Bootstrap] = {}
        self.route = {SEEDS[i]: f"10.0.0.{i}:7980" for i in range(3)}
        for i in range(n):
            name, addr = f"n{i}", f"10.0.0.{i}:7980"
            book = KeyBook(name, DigestCrypto.for_name(name), pinned=pins or {}) if signed else None
            self.boots[name] = Bootstrap(self.params, Candidate(name, addr, f"host{i}", 0), 0.0, random.Random(i), book)
        self.by_addr = {b.me.addr: b for b in self.boots.values()}
        self.drop: Callable[[str, str, Message], bool] = lambda src, dst, msg: False
        self.t = 0.0

    def deliver(self, dst: str, msg: Message) -> None:
        b = self.by_addr.get(self.route.get(dst, dst))
        if b is not None:
            b.on_message(wire(msg), self.t)

    def run(self, until: float) -> None:
        while self.t < until:
            for b in self.boots.values():
                b.tick(self.t)
            for _ in range(100):
                sent = [(name, out) for name, b in self.boots.items() for out in b.take()]
                for name, (dst, msg, _) in sent:
                    if not self.drop(name, dst, msg):
                        self.deliver(dst, msg)
                if not sent:
                    break
            self.t += 0.05

    def decided(self) -> list[str]:
        return [name for name, b in self.boots.items() if b.decided is not None]


def forger_row(name: str, addr: str) -> tuple[Any, ...]:
    """A row the forger signs with its own key (it holds no candidate's key)."""
    return Candidate(name, addr, "hostz", 0).signed_by(KeyBook("forger", FORGER)).row()


def signed(msg: Message, crypto: DigestCrypto = FORGER) -> Message:
    msg.sig = crypto.sign(signed_bytes(msg))  # type: ignore[attr-defined]
    return msg


def delta(b: Bootstrap, key: str, act: Callable[[], object]) -> int:
    before = b.counters.get(key, 0)
    act()
    return b.counters.get(key, 0) - before


def test_an_honest_signed_bootstrap_decides_one_view_zero_with_every_members_key() -> None:
    net = Net(5)
    net.run(3.0)
    values = {b.decided for b in net.boots.values()}
    assert len(values) == 1 and None not in values
    (value,) = values
    assert value is not None and [c.name for c in value] == ["n0", "n1", "n2", "n3", "n4"]
    assert boot_keys(value) == {f"n{i}": DigestCrypto.for_name(f"n{i}").public_key for i in range(5)}
    # seeds named by addresses they do not advertise: each bound from its own signed answers
    assert net.boots["n4"].seed_of == {SEEDS[i]: f"n{i}" for i in range(3)}
    decision = net.boots["n4"].decision
    assert decision is not None and len(decision.proof) >= 2
    assert {n for n, b in net.boots.items() if b.counters.get("boot_rounds")} <= {"n0", "n1", "n2"}  # seeds propose
    for b in net.boots.values():
        refused = {k: v for k, v in b.counters.items() if k.startswith("rx_")}
        assert not refused, (b.me.name, refused)


def test_an_unsigned_bootstrap_still_decides() -> None:
    net = Net(4, signed=False)
    net.run(3.0)
    assert len(net.decided()) == 4
    assert all(not c.key and not c.sig for c in net.boots["n0"].decided or ())


def test_forged_accepteds_in_the_seeds_names_decide_nothing() -> None:
    """Seeds 1 and 2 never get an accept; the forger answers each in their name: unsigned, signed with its
    own key under the seed's name, or as a candidate of its own (its row sent first)."""
    net = Net(4)
    attempts: list[Message] = []

    def drop(src: str, dst: str, msg: Message) -> bool:
        if isinstance(msg, BootAccept) and dst in SEEDS[1:]:
            digest = value_digest(Candidate.of(r) for r in msg.value)
            net.deliver(msg.reply_to, BootKnown(dst, "x", (forger_row("x", "10.9.9.9:1"),)))
            for signer, sign in (("n1", False), ("n1", True), ("x", True)):  # unsigned, n1 by x's key, x itself
                acc = BootAccepted(dst, True, msg.round, msg.proposer, digest, signer)
                attempts.append(signed(acc) if sign else acc)
                net.deliver(msg.reply_to, attempts[-1])
            return True
        return False

    net.drop = drop
    net.run(6.0)
    assert attempts, "the proposers reached phase 2"
    assert net.decided() == [], "no majority of the seeds accepted"
    total: dict[str, int] = {}
    for b in net.boots.values():
        for k in ("rx_boot_unsigned", "rx_sig_invalid", "rx_boot_key_conflict"):
            total[k] = total.get(k, 0) + b.counters.get(k, 0)
    assert all(total.values()), total


def test_forged_promises_carrying_a_forged_value_are_not_counted() -> None:
    """Seeds 1 and 2 never get a prepare; the forger promises in their name, reporting as accepted a
    value of its choosing (the forger itself in n3's place)."""
    net = Net(4)
    x = forger_row("x", "10.9.9.9:1")
    evil = (*_rows(net.boots[n].me for n in ("n0", "n1", "n2")), x)
    proposed: list[tuple[Any, ...]] = []

    def drop(src: str, dst: str, msg: Message) -> bool:
        if isinstance(msg, BootAccept):
            proposed.append(msg.value)
        if isinstance(msg, BootPrepare) and dst in SEEDS[1:]:
            for signer in ("n1", "x"):
                p = BootPromise(dst, True, msg.round, msg.proposer, 2**30, "x", evil, (x,), signer)
                net.deliver(msg.reply_to, signed(p) if signer == "n1" else p)  # n1 by x's key; x unsigned
            return True
        return False

    net.drop = drop
    net.run(6.0)
    assert net.decided() == [] and proposed == [], "no proposer got a quorum of promises"
    assert sum(b.counters.get("rx_sig_invalid", 0) for b in net.boots.values()) > 0
    assert sum(b.counters.get("rx_boot_unsigned", 0) for b in net.boots.values()) > 0


def test_a_value_put_in_another_proposers_ballot_or_by_a_non_seed_is_not_accepted() -> None:
    """Paxos holds only while each ballot has one value and its proposer ran phase 1: the forger can put
    neither another value in a seed's ballot (its accept is not signed by that seed) nor, as a candidate of
    its own, a value straight into phase 2 (only the seeds propose), nor stall the seeds with a huge round."""
    net = Net(4)
    x = forger_row("x", "10.9.9.9:1")
    net.run(0.01)
    for b in net.boots.values():
        b.on_message(wire(BootKnown("", "x", (x,))), 0.0)  # the forger, a candidate like any other
    evil = (*_rows(net.boots[n].me for n in ("n0", "n1", "n2")), x)
    sent: list[BootAccept] = []

    def drop(src: str, dst: str, msg: Message) -> bool:
        if isinstance(msg, BootAccept) and not sent:
            sent.append(msg)
            for seed in SEEDS:
                net.deliver(seed, BootAccept(msg.round, msg.proposer, seed, "10.9.9.9:1", evil))  # unsigned
                net.deliver(seed, signed(BootAccept(msg.round, msg.proposer, seed, "10.9.9.9:1", evil)))
                net.deliver(seed, signed(BootAccept(2**31, "x", seed, "10.9.9.9:1", evil)))
                net.deliver(seed, signed(BootPrepare(2**31, "x", seed, "10.9.9.9:1")))
        return False

    net.drop = drop
    net.run(3.0)
    assert sent, "a seed proposed"
    seeds = [net.boots[n] for n in ("n0", "n1", "n2")]
    assert sum(b.counters.get("rx_boot_unsigned", 0) for b in seeds) == 3
    assert sum(b.counters.get("rx_sig_invalid", 0) for b in seeds) == 3
    assert sum(b.counters.get("rx_boot_not_seed", 0) for b in seeds) == 6
    values = {b.decided for b in net.boots.values()}
    assert len(values) == 1 and [c.name for c in next(iter(values)) or ()] == ["n0", "n1", "n2", "n3"]
    # a seed's own signed prepare, passed on by the forger to a candidate that is not that seed (another
    # seed, or none): neither answers as the seed it is not
    prepare = signed(BootPrepare(9, "n0", SEEDS[1], "10.9.9.9:1"), DigestCrypto.for_name("n0"))
    for b in (net.boots["n2"], net.boots["n3"]):
        before = b.counters.get("rx_boot_not_seed", 0)
        b.on_message(wire(prepare), net.t)
        assert b.counters["rx_boot_not_seed"] == before + 1 and not b.take()


def test_a_bare_or_badly_proven_boot_decided_decides_nothing() -> None:
    honest = Net(4)
    honest.run(3.0)
    real = honest.boots["n0"].decision
    assert real is not None and real.proof
    # a fresh job of the same candidates whose Paxos cannot finish (every prepare lost)
    net = Net(4)
    net.drop = lambda src, dst, msg: isinstance(msg, BootPrepare)
    net.run(2.0)
    target = net.boots["n3"]
    assert target.known.keys() == {"n0", "n1", "n2", "n3"} and target.decided is None
    value = real.value
    other = (*value[:3], forger_row("x", "10.9.9.9:1"))
    cases = [
        BootDecided(value, real.round, real.proposer),  # no proof at all
        BootDecided(other, real.round, real.proposer, real.proof),  # a real proof, of another value
        BootDecided(value, real.round + 1, real.proposer, real.proof),  # a real proof, of another ballot
        BootDecided(value, real.round, real.proposer,  # the seeds' rows, the forger's signatures
                    tuple((seed, row, FORGER.sign(b"x")) for seed, row, _ in real.proof)),
        BootDecided(value, real.round, real.proposer, (real.proof[0], real.proof[0])),  # one seed twice
    ]
    for msg in cases:
        net.deliver("10.0.0.3:7980", msg)
        assert target.decided is None, msg
    assert target.counters.get("rx_boot_decided_unproven", 0) == len(cases)
    # the real decision, proven by the seeds' own signatures, is learned
    net.deliver("10.0.0.3:7980", real)
    assert target.decided is not None and [c.name for c in target.decided] == ["n0", "n1", "n2", "n3"]


def test_a_row_or_hello_in_another_candidates_name_is_refused() -> None:
    net = Net(4)
    net.run(0.5)
    seed = net.boots["n0"]
    real = seed.known["n1"]
    assert real.key == DigestCrypto.for_name("n1").public_key
    evil = Candidate.of(forger_row("n1", "10.9.9.9:1"))  # n1's name, the forger's key
    hello = signed(BootHello(evil.row(), 4, 0, 1, SEEDS[0]))
    assert delta(seed, "rx_boot_key_conflict", lambda: seed.on_message(wire(hello), net.t)) == 1
    known = BootKnown(SEEDS[1], "n1", (evil.row(),))
    assert delta(seed, "rx_boot_key_conflict", lambda: seed.on_message(wire(known), net.t)) == 1
    # n1's key and signature on a row whose address the forger changed
    moved = Candidate(real.name, "10.9.9.9:1", real.host, real.local, real.spare, real.key, real.sig)
    known = BootKnown(SEEDS[1], "n1", (moved.row(),))
    assert delta(seed, "rx_boot_sig_invalid", lambda: seed.on_message(wire(known), net.t)) == 1
    # n1's real row, in a hello whose job size the forger changed (a mismatch in n1's name)
    hello = signed(BootHello(real.row(), 8, 0, 1, SEEDS[0]))
    assert delta(seed, "rx_sig_invalid", lambda: seed.on_message(wire(hello), net.t)) == 1
    hello = BootHello(real.row(), 8, 0, 1, SEEDS[0])
    assert delta(seed, "rx_boot_unsigned", lambda: seed.on_message(wire(hello), net.t)) == 1
    assert seed.known["n1"] == real and not any(isinstance(e, BootMismatch) for e in seed.events)


def test_pinned_keys_close_the_first_use_window() -> None:
    """Unpinned, the first key seen for a name is bound (trust on first use); pinned, the forger's row
    is refused even when it arrives first."""
    pins = {f"n{i}": DigestCrypto.for_name(f"n{i}").public_key for i in range(4)}
    for pinned, bound in ((False, FORGER.public_key), (True, pins["n1"])):
        net = Net(4, pins=pins if pinned else None)
        seed = net.boots["n0"]
        seed.on_message(wire(BootKnown("", "x", (forger_row("n1", "10.9.9.9:1"),))), 0.0)
        net.run(2.0)
        assert seed.book is not None and seed.book.key_of("n1") == bound


def run_agents(machines: dict[str, Booting], until: float = 3.0) -> None:
    """Booting machines by advertised address, the seeds routed to the first three."""
    route = {SEEDS[i]: f"10.0.0.{i}:7980" for i in range(3)}
    t = 0.0
    while t < until and not all(m.node is not None for m in machines.values()):
        for m in machines.values():
            m.tick(t)
        for _ in range(50):
            sends = [s for m in machines.values() for s in m.take_sends()]
            for s in sends:
                dst = machines.get(route.get(s.addr, s.addr))
                if dst is not None:
                    dst.receive(s.payload, t, s.reliable)
            if not sends:
                break
        t += 0.05


def agent(settings: Any, i: int) -> Booting:
    made = boot_factory(settings)(Config(), f"n{i}", f"10.0.0.{i}:7980", incarnation=1, role="trainer", now=0.0,
                                  rng=random.Random(i))
    assert isinstance(made, Booting)
    return made


def test_the_nodes_built_from_view_zero_hold_every_members_key() -> None:
    """The agents' own factory (real Ed25519 keys): after the bootstrap each node's key book has every
    member of view 0 bound, with the key that member signs with."""
    settings = load_settings({"nnodes": 1, "nproc_per_node": 3, "seeds": SEEDS, "insecure": True}, environ={})
    machines = {f"10.0.0.{i}:7980": agent(settings, i) for i in range(3)}
    run_agents(machines)
    keys = {m.boot.me.name: m.boot.me.key for m in machines.values()}
    assert len(set(keys.values())) == 3 and all(len(k) == 32 for k in keys.values())
    for m in machines.values():
        node = m.node
        assert isinstance(node, Node) and node.auth is not None and node.view is not None
        assert {n: node.auth.key_of(n) for n in keys} == keys
        assert node.auth.crypto.public_key == keys[m.boot.me.name] and node.auth.claims


def test_public_keys_pin_a_bootstrap_to_the_agents_they_name(tmp_path: Path) -> None:
    keys = {f"n{i}": str(tmp_path / f"n{i}.sign") for i in range(4)}
    table = "\n".join(f'{n} = "{load_signing_key(p)[0].public_key.hex()}"' for n, p in keys.items() if n != "n3")
    (tmp_path / "keys.toml").write_text(f"[public_keys]\n{table}\n")

    def settings(i: int) -> Any:
        return load_settings({"nnodes": 1, "nproc_per_node": 3, "seeds": SEEDS, "insecure": True,
                              "public_keys": str(tmp_path / "keys.toml"), "signing_key": keys[f"n{i}"]}, environ={})

    with pytest.raises(ConfigError, match="names no key for n3: only the agents it names take part"):
        agent(settings(3), 3)
    with pytest.raises(ConfigError, match="pins the keys of a bootstrap"):
        load_settings({"public_keys": str(tmp_path / "keys.toml"), "insecure": True}, environ={})
    machines = {f"10.0.0.{i}:7980": agent(settings(i), i) for i in range(3)}
    for m in machines.values():  # a candidate the table does not name, first at every agent: not bound
        m.boot.on_message(wire(BootKnown("", "x", (forger_row("x", "10.9.9.9:1"),))), 0.0)
        assert m.boot.counters["rx_boot_unpinned"] == 1 and "x" not in m.boot.known
    run_agents(machines)
    for m in machines.values():
        node = m.node
        assert isinstance(node, Node) and node.auth is not None and node.view is not None
        assert sorted(node.auth.pinned) == ["n0", "n1", "n2"] and not node.auth.claims
