"""Sealing/opening: round trip, every refusal reason, replay window, rotation, streams, fuzzing."""

from __future__ import annotations

import gc
import logging
import random
import struct
import tracemalloc
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossiprec.errors import ConfigError, SecurityError
from gossiprec.security.crypto import (
    HEADER_SIZE,
    MAX_COUNTER,
    OVERHEAD,
    REASONS,
    CryptoLimits,
    Opener,
    OpenError,
    RejectCounter,
    RejectLog,
    ReplayWindow,
    Sealer,
    SealError,
    StreamSealer,
    TokenBucket,
    VERSION,
    receiver_tag,
)
from gossiprec.security.keyring import Keyring, key_id

OLD = bytes(range(32))
NEW = bytes(range(100, 132))
OTHER = bytes(range(200, 232))
CLUSTER = "train-a"
BOOT = bytes(range(16))


class CountingAead:
    """Wraps AESGCM and counts calls, to prove that cheap checks run before any decryption."""

    calls = {"encrypt": 0, "decrypt": 0, "derive": 0}

    def __init__(self, key: bytes) -> None:
        CountingAead.calls["derive"] += 1
        self._inner = AESGCM(key)

    def encrypt(self, nonce: bytes, data: bytes, ad: bytes | None) -> bytes:
        CountingAead.calls["encrypt"] += 1
        return self._inner.encrypt(nonce, data, ad)

    def decrypt(self, nonce: bytes, data: bytes, ad: bytes | None) -> bytes:
        CountingAead.calls["decrypt"] += 1
        return self._inner.decrypt(nonce, data, ad)


@pytest.fixture
def counting() -> dict[str, int]:
    CountingAead.calls = {"encrypt": 0, "decrypt": 0, "derive": 0}
    return CountingAead.calls


def pair(keys: list[bytes] | None = None) -> tuple[Sealer, Opener]:
    """A sender and a receiver, each with its own keyring holding ``keys``."""
    return Sealer(Keyring(keys or [OLD]), CLUSTER, boot_id=BOOT), Opener(Keyring(keys or [OLD]), CLUSTER)


def reason_of(opener: Opener, data: bytes, source: object = None) -> str:
    with pytest.raises(OpenError) as info:
        opener.open(data, source)
    assert info.value.reason in REASONS
    return info.value.reason


def test_round_trip_and_layout() -> None:
    sealer, opener = pair()
    pkt = sealer.seal(b"hello")
    assert len(pkt) == 5 + OVERHEAD and OVERHEAD == HEADER_SIZE + 16 == 60
    assert pkt[:2] == b"GR" and pkt[4:12] == key_id(OLD) and pkt[12:28] == BOOT
    assert b"hello" not in pkt
    assert opener.open(pkt) == (BOOT, b"hello")
    assert opener.open(sealer.seal(b"")) == (BOOT, b"")
    assert opener.rejects.total == 0


def test_random_boot_ids_differ_and_same_plaintext_never_repeats_ciphertext() -> None:
    ring = Keyring([OLD])
    a, b = Sealer(ring, CLUSTER), Sealer(ring, CLUSTER)
    assert a.boot_id != b.boot_id and len(a.boot_id) == 16
    bodies = {a.seal(b"x")[HEADER_SIZE:] for _ in range(3)} | {b.seal(b"x")[HEADER_SIZE:]}
    assert len(bodies) == 4


def test_wrong_key_and_wrong_cluster() -> None:
    sealer = Sealer(Keyring([OLD]), CLUSTER)
    pkt = sealer.seal(b"data")
    assert reason_of(Opener(Keyring([OTHER]), CLUSTER), pkt) == "unknown_key"
    assert reason_of(Opener(Keyring([OLD]), "train-b"), pkt) == "auth_failed"


def test_tampering_any_byte_is_refused() -> None:
    sealer, opener = pair()
    pkt = sealer.seal(b"small payload!")
    expected = {0: "bad_magic", 1: "bad_magic", 2: "bad_version", 3: "bad_magic"}
    for pos in range(len(pkt)):
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(pkt)
            bad[pos] ^= flip
            want = expected.get(pos, "unknown_key" if 4 <= pos < 12 else "auth_failed")
            assert reason_of(opener, bytes(bad)) == want, (pos, flip)
    # none of the forgeries touched replay state: the genuine packet still opens, once
    assert opener.open(pkt)[1] == b"small payload!"
    assert reason_of(opener, pkt) == "replay"
    assert opener.tracked_senders == 1 and opener.cached_subkeys == 1


def test_replay_of_same_packet_refused_before_decrypt(counting: dict[str, int]) -> None:
    ring = Keyring([OLD])
    sealer = Sealer(ring, CLUSTER)
    opener = Opener(ring, CLUSTER, aead_factory=CountingAead)
    pkt = sealer.seal(b"once")
    opener.open(pkt)
    decrypts = counting["decrypt"]
    for _ in range(3):
        assert reason_of(opener, pkt) == "replay"
    assert counting["decrypt"] == decrypts
    assert opener.rejects["replay"] == 3


def test_out_of_window_counter_refused_reordering_within_window_accepted() -> None:
    ring = Keyring([OLD])
    opener = Opener(ring, CLUSTER, limits=CryptoLimits(replay_window=64))
    early = Sealer(ring, CLUSTER, boot_id=BOOT)
    old_pkts = [early.seal(bytes([i])) for i in range(10)]
    rng = random.Random(7)
    shuffled = old_pkts[:]
    rng.shuffle(shuffled)
    got = sorted(opener.open(p)[1] for p in shuffled)
    assert got == [bytes([i]) for i in range(10)]
    assert all(reason_of(opener, p) == "replay" for p in old_pkts)

    late = Sealer(ring, CLUSTER, boot_id=BOOT, start_counter=100)
    lp = [late.seal(b"late") for _ in range(3)]
    opener.open(lp[2])  # highest is now 102; 0..38 fall outside a 64 window
    older = Sealer(ring, CLUSTER, boot_id=BOOT, start_counter=20).seal(b"too old")
    with pytest.raises(OpenError, match="older than the window"):
        opener.open(older)
    in_window = Sealer(ring, CLUSTER, boot_id=BOOT, start_counter=50).seal(b"reordered")
    assert opener.open(in_window)[1] == b"reordered"
    assert opener.open(lp[0])[1] == b"late" and opener.open(lp[1])[1] == b"late"


@pytest.mark.parametrize(
    ("ops", "probe", "ok"),
    [
        ([], 0, True),
        ([0], 0, False),
        ([5], 4, True),
        ([5, 4], 4, False),
        ([1023], 0, True),
        ([1024], 0, False),
        ([3, 1030], 7, True),
        ([3, 1030], 6, False),
        ([10, 5000], 3976, False),
        ([10, 5000], 3977, True),
    ],
)
def test_replay_window_table(ops: list[int], probe: int, ok: bool) -> None:
    w = ReplayWindow(1024)
    for c in ops:
        assert w.check(c) is None
        w.update(c)
    assert (w.check(probe) is None) is ok


def test_truncated_packets_refused() -> None:
    sealer, opener = pair()
    pkt = sealer.seal(b"0123456789")
    for n in range(OVERHEAD):
        assert reason_of(opener, pkt[:n]) == "truncated"
    for n in range(OVERHEAD, len(pkt)):
        assert reason_of(opener, pkt[:n]) == "auth_failed"
    assert opener.open(pkt)[1] == b"0123456789"


def test_oversized_refused_before_any_crypto(counting: dict[str, int]) -> None:
    ring = Keyring([OLD])
    limits = CryptoLimits(max_payload=100)
    sealer = Sealer(ring, CLUSTER, limits=CryptoLimits(max_payload=200))
    opener = Opener(ring, CLUSTER, limits=limits, aead_factory=CountingAead)
    assert opener.limits.max_datagram == 100 + OVERHEAD
    assert opener.open(sealer.seal(b"y" * 100))[1] == b"y" * 100
    before = dict(counting)
    assert reason_of(opener, sealer.seal(b"y" * 101)) == "too_large"
    assert reason_of(opener, b"\x00" * 10_000) == "too_large"
    assert counting == before, "no key derivation nor decryption for oversized packets"
    with pytest.raises(SealError, match="too_large"):
        Sealer(ring, CLUSTER, limits=limits).seal(b"z" * 101)


def test_unknown_key_refused_without_crypto(counting: dict[str, int]) -> None:
    sealer = Sealer(Keyring([OTHER]), CLUSTER)
    opener = Opener(Keyring([OLD]), CLUSTER, aead_factory=CountingAead)
    with pytest.raises(OpenError, match=key_id(OTHER).hex()) as info:
        opener.open(sealer.seal(b"x"))
    assert info.value.reason == "unknown_key" and isinstance(info.value, SecurityError)
    assert counting["derive"] == 0 and counting["decrypt"] == 0


def test_forged_packets_do_not_grow_state() -> None:
    sealer, opener = pair()
    opener.open(sealer.seal(b"real"))
    rng = random.Random(3)
    genuine = sealer.seal(b"x")
    for _ in range(200):
        forged = bytearray(genuine)
        forged[12:28] = rng.randbytes(16)  # a fresh sender id with a valid key id
        assert reason_of(opener, bytes(forged)) == "auth_failed"
    assert opener.tracked_senders == 1 and opener.cached_subkeys == 1
    assert opener.rejects["auth_failed"] == 200


def test_sender_lru_is_bounded() -> None:
    ring = Keyring([OLD])
    opener = Opener(ring, CLUSTER, limits=CryptoLimits(max_senders=3, max_subkeys=2))
    for _ in range(10):
        opener.open(Sealer(ring, CLUSTER).seal(b"hi"))
    assert opener.tracked_senders == 3 and opener.cached_subkeys == 2


def test_rotation_live_with_packets_in_flight(tmp_path: Path) -> None:
    """install new everywhere -> use new everywhere -> remove old everywhere, never dropping a packet
    that was sealed with a key the receiver still holds."""
    a_ring, b_ring = Keyring([OLD]), Keyring([OLD])
    a = Sealer(a_ring, CLUSTER)
    b_open = Opener(b_ring, CLUSTER)
    in_flight = [a.seal(b"old-1")]

    b_ring.install(NEW)
    a_ring.install(NEW)
    in_flight.append(a.seal(b"old-2"))  # installing does not change what A seals with
    assert in_flight[-1][4:12] == key_id(OLD)

    a_ring.use(NEW)  # A switches without restart
    p_new = a.seal(b"new-1")
    assert p_new[4:12] == key_id(NEW)
    assert b_open.open(p_new)[1] == b"new-1"
    assert [b_open.open(p)[1] for p in in_flight] == [b"old-1", b"old-2"]  # late, reordered: fine

    straggler = Sealer(Keyring([OLD]), CLUSTER).seal(b"old-3")  # a node that has not switched yet
    b_ring.use(NEW)
    b_ring.remove(OLD)
    assert reason_of(b_open, straggler) == "unknown_key"
    assert b_open.open(a.seal(b"new-2"))[1] == b"new-2"
    with pytest.raises(SecurityError):
        b_ring.remove(NEW)


def test_sealer_follows_keyring_file_reload(tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    Keyring([OLD]).save(path)
    agent_ring = Keyring.load(path)
    sealer = Sealer(agent_ring, CLUSTER)
    assert sealer.seal(b"a")[4:12] == key_id(OLD)
    cli = Keyring.load(path)
    cli.install(NEW)
    cli.use(NEW)
    cli.save(path)
    assert agent_ring.load_if_changed() is True
    assert sealer.seal(b"b")[4:12] == key_id(NEW)


def test_seal_refusals() -> None:
    with pytest.raises(SealError, match="no_key"):
        Sealer(Keyring(), CLUSTER).seal(b"x")
    s = Sealer(Keyring([OLD]), CLUSTER, start_counter=MAX_COUNTER - 1)
    s.seal(b"last one")
    with pytest.raises(SealError, match="exhausted"):
        s.seal(b"x")


def test_insecure_mode_is_explicit_and_never_mixes_with_keys() -> None:
    with pytest.raises(ConfigError, match="insecure"):
        Opener(None, CLUSTER)
    with pytest.raises(ConfigError, match="exclusive"):
        Opener(Keyring([OLD]), CLUSTER, insecure=True)
    with pytest.raises(ConfigError):
        Sealer(Keyring([OLD]), CLUSTER, insecure=True)

    plain = Sealer(None, CLUSTER, insecure=True, boot_id=BOOT)
    pkt = plain.seal(b"visible")
    assert pkt.endswith(b"visible") and len(pkt) == HEADER_SIZE + 7
    assert Opener(None, CLUSTER, insecure=True).open(pkt) == (BOOT, b"visible")
    assert reason_of(Opener(None, "other", insecure=True), pkt) == "unknown_key"

    keyed = Opener(Keyring([OLD]), CLUSTER)
    with pytest.raises(OpenError, match="runs --insecure but this node has a key") as info:
        keyed.open(pkt)
    assert info.value.reason == "bad_magic"
    # rewriting the kind byte to "sealed" gets nowhere either: no valid tag
    forged = bytearray(pkt)
    forged[3] = 0x01
    forged[4:12] = key_id(OLD)
    forged += b"\x00" * 16
    assert reason_of(keyed, bytes(forged)) == "auth_failed"
    sealed = Sealer(Keyring([OLD]), CLUSTER).seal(b"secret")
    assert reason_of(Opener(None, CLUSTER, insecure=True), sealed) == "bad_magic"


def test_reject_counter_and_rate_limited_log(caplog: pytest.LogCaptureFixture) -> None:
    sealer, opener = pair()
    pkt = sealer.seal(b"x")
    opener.open(pkt)
    logger = logging.getLogger("test.crypto.rejects")
    rlog = RejectLog(logger, interval_s=10.0)
    now = 1000.0
    with caplog.at_level(logging.WARNING, logger="test.crypto.rejects"):
        logged = []
        for i in range(5):
            for data in (pkt, b"XX" + pkt[2:]):
                try:
                    opener.open(data)
                except OpenError as exc:
                    logged.append(rlog.note(exc, now + i, peer="10.0.0.2:7946"))
        assert logged == [True, True] + [False] * 8
        assert rlog.note(OpenError("replay", "again"), now + 10.0) is True
    assert dict(opener.rejects) == {**dict.fromkeys(REASONS, 0), "replay": 5, "bad_magic": 5}
    assert opener.rejects.total == 10 and isinstance(opener.rejects, RejectCounter)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "10.0.0.2:7946" in lines[0] and "(+4 more" in lines[2]


# --- streams -----------------------------------------------------------------------------------

def stream_pair() -> tuple[StreamSealer, Opener]:
    ring = Keyring([OLD])
    return Sealer(ring, CLUSTER).new_stream(), Opener(ring, CLUSTER)


def test_stream_round_trip_any_chunking() -> None:
    ss, opener = stream_pair()
    payloads = [b"", b"a", b"x" * 5000, b"end"]
    wire = b"".join(ss.seal_frame(p) for p in payloads)
    so = opener.new_stream()
    assert so.feed(wire) == payloads
    ss2, _ = stream_pair()
    so2 = Opener(Keyring([OLD]), CLUSTER).new_stream()
    wire2 = b"".join(ss2.seal_frame(p) for p in payloads)
    got: list[bytes] = []
    rng = random.Random(1)
    i = 0
    while i < len(wire2):
        n = rng.randint(1, 700)
        got += so2.feed(wire2[i:i + n])
        i += n
    assert got == payloads and so2.buffered == 0 and so2.stream_id == ss2.sender_id


def test_stream_replay_reorder_and_poisoning() -> None:
    ss, opener = stream_pair()
    f = [ss.seal_frame(bytes([i])) for i in range(3)]
    so = opener.new_stream()
    assert so.feed(f[0] + f[1]) == [b"\x00", b"\x01"]
    with pytest.raises(OpenError, match="expected 3") as info:
        so.feed(f[1])  # duplicate inside the stream (counter 0 is the opening frame)
    assert info.value.reason == "replay"
    with pytest.raises(OpenError):
        so.feed(f[2])  # poisoned: the connection must be closed
    replayed = opener.new_stream()
    with pytest.raises(OpenError, match="another connection"):
        replayed.feed(f[0])  # the whole recorded connection replayed on a new one
    reordered = Opener(Keyring([OLD]), CLUSTER).new_stream()
    with pytest.raises(OpenError, match="expected 0"):
        reordered.feed(f[1])


def test_stream_oversized_length_refused_before_body(counting: dict[str, int]) -> None:
    ring = Keyring([OLD])
    limits = CryptoLimits(max_frame_payload=1000)
    opener = Opener(ring, CLUSTER, limits=limits, aead_factory=CountingAead)
    so = opener.new_stream()
    with pytest.raises(OpenError) as info:
        so.feed((limits.max_frame + 1).to_bytes(4, "big"))  # only the prefix has arrived
    assert info.value.reason == "too_large" and counting["decrypt"] == 0
    short = opener.new_stream()
    with pytest.raises(OpenError) as info:
        short.feed((OVERHEAD - 1).to_bytes(4, "big"))
    assert info.value.reason == "truncated"
    with pytest.raises(SealError):
        StreamSealer(ring, CLUSTER, limits=limits).seal_frame(b"z" * 1001)


def test_stream_tamper_and_kind_confusion() -> None:
    ss, opener = stream_pair()
    frame = bytearray(ss.seal_frame(b"payload"))
    frame[-1] ^= 1
    with pytest.raises(OpenError, match="auth_failed"):
        opener.new_stream().feed(bytes(frame))
    dgram = Sealer(Keyring([OLD]), CLUSTER).seal(b"")  # the opening frame's size
    with pytest.raises(OpenError, match="expected a sealed stream frame"):
        opener.new_stream().feed(len(dgram).to_bytes(4, "big") + dgram)
    frame_body = ss.seal_frame(b"f")[4:]
    assert reason_of(opener, frame_body) == "bad_magic"


def test_stream_follows_rotation_mid_connection() -> None:
    ring = Keyring([OLD, NEW])
    ss = Sealer(ring, CLUSTER).new_stream()
    so = Opener(Keyring([OLD, NEW]), CLUSTER).new_stream()
    a = ss.seal_frame(b"1")
    ring.use(NEW)
    b = ss.seal_frame(b"2")
    assert a[8:16] == key_id(OLD) and b[8:16] == key_id(NEW)
    assert so.feed(a + b) == [b"1", b"2"]


def test_insecure_stream_round_trip() -> None:
    ss = StreamSealer(None, CLUSTER, insecure=True)
    so = Opener(None, CLUSTER, insecure=True).new_stream()
    assert so.feed(ss.seal_frame(b"a") + ss.seal_frame(b"b")) == [b"a", b"b"]


# --- fuzzing: nothing but SecurityError ever escapes -------------------------------------------

_RING = Keyring([OLD])
_SEALER = Sealer(_RING, CLUSTER, boot_id=BOOT)
_VALID = [_SEALER.seal(bytes(n)) for n in (0, 1, 17, 64)]
_FRAMES = _SEALER.new_stream()
_VALID_STREAM = b"".join(_FRAMES.seal_frame(bytes(n)) for n in (0, 3, 40))
_FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.binary(max_size=2000))
def test_fuzz_random_bytes_only_security_errors(data: bytes) -> None:
    opener = Opener(_RING, CLUSTER, limits=CryptoLimits(max_payload=1400))
    prefix = b"GR" + bytes((VERSION, 1))
    for candidate in (data, prefix + data, prefix + key_id(OLD) + data):
        try:
            opener.open(candidate)
        except OpenError as exc:
            assert exc.reason in REASONS
        else:
            pytest.fail("random bytes authenticated")


@_FUZZ
@given(st.sampled_from(_VALID), st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)),
                                         max_size=4),
       st.integers(-5, 5), st.binary(max_size=8))
def test_fuzz_mutated_packets_only_security_errors(pkt: bytes, edits: list[tuple[int, int]],
                                                   cut: int, tail: bytes) -> None:
    data = bytearray(pkt)
    for pos, val in edits:
        data[pos % len(data)] = val
    data = data[:len(data) + cut] if cut < 0 else data + tail[:cut]
    opener = Opener(_RING, CLUSTER)
    try:
        boot, plain = opener.open(bytes(data))
    except OpenError as exc:
        assert exc.reason in REASONS
    else:
        assert bytes(data) == pkt and boot == BOOT, "only the untouched packet may open"


@_FUZZ
@given(st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=3),
       st.binary(max_size=300), st.integers(1, 64))
def test_fuzz_streams_only_security_errors(edits: list[tuple[int, int]], junk: bytes,
                                           chunk: int) -> None:
    data = bytearray(_VALID_STREAM)
    for pos, val in edits:
        data[pos % len(data)] = val
    data += junk
    so = Opener(_RING, CLUSTER, limits=CryptoLimits(max_frame_payload=512)).new_stream()
    try:
        for i in range(0, len(data), chunk):
            so.feed(bytes(data[i:i + chunk]))
    except OpenError as exc:
        assert exc.reason in REASONS



# --- receiver binding, format version, forgery cost, stream memory -------------------------------

def test_datagram_sealed_for_one_member_is_refused_by_another(counting: dict[str, int]) -> None:
    ring = Keyring([OLD])
    sealer = Sealer(ring, CLUSTER, boot_id=BOOT)
    to_a = Opener(ring, CLUSTER, receiver="10.0.0.1:7980")
    to_b = Opener(ring, CLUSTER, receiver="10.0.0.2:7980", aead_factory=CountingAead)
    pkt = sealer.seal(b"for a", to="10.0.0.1:7980")
    assert pkt[HEADER_SIZE - 8:HEADER_SIZE] == receiver_tag("10.0.0.1:7980")
    assert reason_of(to_b, pkt) == "wrong_receiver"  # the replay to b: refused before any cryptography
    assert counting["derive"] == 0 and counting["decrypt"] == 0
    assert to_a.open(pkt) == (BOOT, b"for a")
    assert to_b.open(sealer.seal(b"for b", to="10.0.0.2:7980"))[1] == b"for b"
    # b now knows the sender: the fast path checks the receiver too
    assert reason_of(to_b, sealer.seal(b"for a", to="10.0.0.1:7980")) == "wrong_receiver"
    assert reason_of(to_b, sealer.seal(b"nobody's")) == "wrong_receiver"
    forged = bytearray(sealer.seal(b"for a", to="10.0.0.1:7980"))
    forged[HEADER_SIZE - 8:HEADER_SIZE] = receiver_tag("10.0.0.2:7980")  # readdressed: the tag fails
    assert reason_of(to_b, bytes(forged)) == "auth_failed"
    assert to_b.rejects["wrong_receiver"] == 3 and to_b.rejects["auth_failed"] == 1
    anyone = Opener(ring, CLUSTER)  # no receiver set (not yet advertised): the field is not checked
    assert anyone.open(sealer.seal(b"x", to="10.0.0.9:1"))[1] == b"x"


def test_a_packet_of_the_previous_sealing_format_is_refused_with_its_reason() -> None:
    ring = Keyring([OLD])
    opener = Opener(ring, CLUSTER)
    old = struct.pack(">2sBB8s16sQ", b"GR", 1, 0x01, key_id(OLD), BOOT, 0) + b"\x00" * 40
    old_frame = struct.pack(">2sBB8s16sQ", b"GR", 1, 0x02, key_id(OLD), BOOT, 0) + b"\x00" * 200
    with pytest.raises(OpenError, match="sealing format 1, this node speaks 2") as info:
        opener.open(old)
    assert info.value.reason == "bad_version" and opener.rejects["bad_version"] == 1
    frame = Opener(ring, CLUSTER).new_stream()
    with pytest.raises(OpenError, match="sealing format 1"):
        frame.feed(len(old_frame).to_bytes(4, "big") + old_frame)  # no opening frame in format 1


def test_forgeries_under_the_real_key_id_cost_a_bounded_number_of_derivations(
        counting: dict[str, int]) -> None:
    ring = Keyring([OLD])
    now = [100.0]
    limits = CryptoLimits(new_sender_rate=10.0, new_sender_burst=20)
    opener = Opener(ring, CLUSTER, limits=limits, aead_factory=CountingAead, clock=lambda: now[0])
    member = Sealer(ring, CLUSTER, boot_id=BOOT)
    assert opener.open(member.seal(b"hello"))[1] == b"hello"  # a known sender before the flood
    rng = random.Random(5)
    template = member.seal(b"x" * 40)
    reasons: dict[str, int] = {}
    for i in range(2000):
        forged = bytearray(template)
        forged[12:28] = rng.randbytes(16)  # a fresh sender id, the cluster's key id
        r = reason_of(opener, bytes(forged))
        reasons[r] = reasons.get(r, 0) + 1
        if i % 100 == 99:
            now[0] += 0.5  # 2000 forgeries over 10 s
            assert opener.open(member.seal(b"still here"))[1] == b"still here"  # known: never throttled
    assert opener.derivations == counting["derive"] <= 20 + 10 * 10  # burst + rate x 10 s, the member's included
    assert reasons == {"auth_failed": opener.derivations - 1, "throttled": 2000 - opener.derivations + 1}
    assert opener.rejects["throttled"] == reasons["throttled"]
    now[0] += 10.0  # the flood is over: a new member is heard at once
    assert opener.open(Sealer(ring, CLUSTER).seal(b"new"))[1] == b"new"
    assert opener.tracked_senders == 2


def test_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    b = TokenBucket(rate=2.0, burst=3)
    assert [b.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert b.take(0.4) is False and b.take(0.5) is True  # 0.5 s at 2/s: one token
    assert [b.take(100.0) for _ in range(4)] == [True, True, True, False]  # never above the burst
    assert b.take(99.0) is False  # a clock that steps back refills nothing


def test_stream_garbage_and_big_declared_frames_are_refused_before_they_are_buffered() -> None:
    ring = Keyring([OLD])
    opener = Opener(ring, CLUSTER)
    so = opener.new_stream()
    assert so.wanted() == 4
    with pytest.raises(OpenError, match="bad_magic"):  # garbage: refused at its header
        so.feed((4 * 1024 * 1024).to_bytes(4, "big") + b"\x00" * 100_000)
    assert so.buffered == 0
    so = opener.new_stream()
    header = Sealer(ring, CLUSTER).new_stream().seal_frame(b"")[4:4 + HEADER_SIZE]  # a real header ...
    assert so.feed((4 * 1024 * 1024).to_bytes(4, "big")) == [] and so.wanted() == HEADER_SIZE
    with pytest.raises(OpenError, match="opening frame") as info:  # ... of a big first frame
        so.feed(header + b"\x00" * 100_000)
    assert info.value.reason == "too_large" and so.buffered == 0
    # an authenticated peer may declare a big frame; a bad header in it is refused after 48 bytes
    ss = Sealer(ring, CLUSTER).new_stream()
    so = opener.new_stream()
    wire = ss.seal_frame(b"y" * 100_000)
    opening, frame = wire[:4 + OVERHEAD], bytearray(wire[4 + OVERHEAD:])
    assert so.feed(opening) == [] and so.authenticated and so.wanted() == 4
    frame[4:6] = b"XX"
    with pytest.raises(OpenError, match="bad_magic"):
        so.feed(bytes(frame))
    assert so.buffered == 0
    with pytest.raises(OpenError, match="bad_magic"):  # poisoned, counted once
        so.next_frame()
    assert opener.rejects["bad_magic"] == 2  # the garbage above, and this frame once
    # what a reader asks for never runs past the frame in hand
    so = opener.new_stream()
    wire = Sealer(ring, CLUSTER).new_stream().seal_frame(b"z" * 5000)
    got, at = [], 0
    while at < len(wire):
        n = so.wanted()
        assert so.buffered + n <= so.frame_size
        so.receive_data(wire[at:at + n])
        at += n
        while (f := so.next_frame()) is not None:
            got.append(f)
    assert got == [b"z" * 5000] and so.buffered == 0


def test_a_refused_frame_is_not_kept_alive_by_the_stored_error() -> None:
    ring = Keyring([OLD])
    so = Opener(ring, CLUSTER, limits=CryptoLimits(max_frame_payload=8 * 1024 * 1024)).new_stream()
    wire = bytearray(Sealer(ring, CLUSTER).new_stream().seal_frame(b"\x00" * (4 * 1024 * 1024)))
    wire[-1] ^= 1  # a bad tag: the whole frame is buffered before it is refused
    gc.collect()
    gc.disable()
    try:
        tracemalloc.start()
        try:
            so.receive_data(bytes(wire[:4 + OVERHEAD]))
            assert so.next_frame() is None
            so.receive_data(bytes(wire[4 + OVERHEAD:]))
            del wire
            with pytest.raises(OpenError, match="auth_failed"):
                so.next_frame()
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    finally:
        gc.enable()
    assert held < 256 * 1024, f"{held} bytes still held by a poisoned opener"
    with pytest.raises(OpenError, match="auth_failed"):
        so.next_frame()


def test_a_member_restarting_at_its_address_is_heard_during_a_forgery_flood() -> None:
    ring = Keyring([OLD])
    now = [0.0]
    opener = Opener(ring, CLUSTER, limits=CryptoLimits(new_sender_rate=1.0, new_sender_burst=5),
                    clock=lambda: now[0])
    member_at = ("10.0.0.7", 7980)
    assert opener.open(Sealer(ring, CLUSTER).seal(b"first life"), member_at)[1] == b"first life"
    template = Sealer(ring, CLUSTER).seal(b"x" * 40)
    rng = random.Random(9)
    for i in range(200):  # forgeries from elsewhere empty the bucket for unknown sources
        forged = bytearray(template)
        forged[12:28] = rng.randbytes(16)
        assert reason_of(opener, bytes(forged), ("10.6.6.6", i)) in ("auth_failed", "throttled")
    assert opener.rejects["throttled"] == 200 - 4  # the burst, less the member's first derivation
    assert reason_of(opener, Sealer(ring, CLUSTER).seal(b"a stranger"), ("10.0.0.8", 1)) == "throttled"
    # the member's new life (a new boot id) from the address it spoke from before: heard at once
    assert opener.open(Sealer(ring, CLUSTER).seal(b"second life"), member_at)[1] == b"second life"
