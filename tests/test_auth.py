"""The key book (gossiprec.core.auth) and the agents' Ed25519 keys (gossiprec.security.signing):
bindings on first use, conflicts refused and counted, removals, pinning, signatures over the wire row
without the sig field, and the verification cache."""

from __future__ import annotations

import pytest

from gossiprec.core.auth import DigestCrypto, KeyBook, signed_bytes
from gossiprec.core.wire import UNREACHABLE, Alert, Dead, JobDone, decode_packet, encode_packet
from gossiprec.security.signing import Ed25519Crypto


def _alert(observer: str = "n1", subject: str = "n2") -> Alert:
    return Alert(3, "0123456789abcdef", observer, subject, 0, UNREACHABLE, False, "", "", "")


@pytest.fixture(params=["ed25519", "digest"])
def pair(request: pytest.FixtureRequest) -> tuple[KeyBook, KeyBook]:
    make = Ed25519Crypto.generate if request.param == "ed25519" else None
    a = KeyBook("n1", make() if make else DigestCrypto.for_name("n1"))
    b = KeyBook("n2", make() if make else DigestCrypto.for_name("n2"))
    return a, b


def test_a_signed_message_checks_after_the_wire_and_nothing_else_does(pair: tuple[KeyBook, KeyBook]) -> None:
    a, b = pair
    assert b.bind("n1", a.crypto.public_key) and not b.bind("n1", a.crypto.public_key)
    msg = a.sign(_alert())
    (back,) = decode_packet(encode_packet([msg]), 1400)
    assert b.check("n1", back)
    assert not b.check("n3", back) and b.counters["rx_sig_unknown_author"] == 1  # no key for that name
    tampered = _alert(subject="n3")
    tampered.sig = msg.sig
    assert not b.check("n1", tampered) and b.counters["rx_sig_invalid"] == 1
    other = Dead("n1", 1, "n1", msg.sig)  # the same signature on another message
    assert not b.check("n1", other) and b.counters["rx_sig_invalid"] == 2
    assert not b.check("n1", _alert()) and b.counters["rx_sig_invalid"] == 3  # unsigned
    assert signed_bytes(msg) == signed_bytes(_alert())  # the signature covers everything but itself


def test_a_claim_for_a_bound_name_is_refused_until_the_member_is_removed(pair: tuple[KeyBook, KeyBook]) -> None:
    a, b = pair
    intruder = DigestCrypto.for_name("intruder")
    b.bind("n1", a.crypto.public_key)
    assert not b.bind("n1", intruder.public_key) and b.counters["rx_key_conflict"] == 1
    assert b.key_of("n1") == a.crypto.public_key
    assert not b.bind("n2", intruder.public_key)  # our own name: never rebound
    b.forget({"n1", "n2"})
    assert b.key_of("n1") is None and b.key_of("n2") == b.crypto.public_key
    assert b.bind("n1", intruder.public_key)  # a new process of n1 (a new key) binds again


def test_pinned_keys_are_never_replaced_nor_forgotten() -> None:
    a = DigestCrypto.for_name("n1")
    b = KeyBook("n2", DigestCrypto.for_name("n2"), pinned={"n1": a.public_key}, claims=False)
    assert not b.bind("n1", b"x" * 16) and b.counters["rx_key_conflict"] == 1
    b.forget({"n1"})
    msg = KeyBook("n1", a).sign(JobDone(1, 5, "n1"))
    assert b.check("n1", msg)


def test_each_distinct_signature_is_verified_once(pair: tuple[KeyBook, KeyBook]) -> None:
    a, b = pair
    b.bind("n1", a.crypto.public_key)
    calls = []
    inner = b.crypto

    class Counting:
        public_key = inner.public_key

        def sign(self, data: bytes) -> bytes:
            return inner.sign(data)

        def verify(self, key: bytes, data: bytes, sig: bytes) -> bool:
            calls.append(sig)
            return inner.verify(key, data, sig)

    b.crypto = Counting()
    msgs = [a.sign(_alert(subject=f"n{i}")) for i in range(3)]
    for _ in range(5):
        for m in msgs:
            (copy,) = decode_packet(encode_packet([m]), 1400)  # every gossiped copy is a new object
            assert b.check("n1", copy)
    assert len(calls) == 3


def test_ed25519_refuses_malformed_keys_and_signatures() -> None:
    c = Ed25519Crypto.generate()
    sig = c.sign(b"data")
    assert len(c.public_key) == 32 and len(sig) == 64 and c.verify(c.public_key, b"data", sig)
    assert not c.verify(c.public_key[:31], b"data", sig)
    assert not c.verify(c.public_key, b"data", sig[:63])
    assert not c.verify(Ed25519Crypto.generate().public_key, b"data", sig)


def test_a_swim_rumour_by_a_member_not_yet_bound_is_vouched_for_and_counted() -> None:
    a, b = DigestCrypto.for_name("n1"), KeyBook("n2", DigestCrypto.for_name("n2"))
    msg = KeyBook("n1", a).sign(JobDone(1, 5, "n1"))
    assert b.vouched("n1", msg) and b.counters["rx_sig_unbound"] == 1  # its claim has not come yet
    b.bind("n1", a.public_key)
    assert b.vouched("n1", msg)
    assert not b.vouched("n1", JobDone(1, 5, "n1")) and b.counters["rx_sig_invalid"] == 1  # bound: its own word
