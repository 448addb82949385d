"""Free loopback ports for a local job's processes, chosen where no outgoing connection takes them first."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; a common default elsewhere)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int, width: int = 1) -> list[int]:
    """``n`` ports p such that TCP p..p+width-1 and UDP p are free on 127.0.0.1 (bound, then released;
    ``width`` 3 for a trainer's agent, store and donor).

    Drawn below the ephemeral range when there is room: a port handed out from that range is free
    now but may be taken by any outgoing connection (gloo's full mesh opens hundreds) before the
    trainer binds its store and donor servers seconds later.
    """
    lo, _ = _ephemeral_range()
    rng = random.Random()
    ports: list[int] = []
    tries = 0
    while len(ports) < n:
        tries += 1
        if lo - 10_000 > 1_000 and tries < 10_000:
            base = rng.randrange(10_000, lo - width)
        else:  # no room below (or no luck): any port the kernel hands out
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
            s.close()
        if base + width >= 65535 or any(abs(base - p) < width + 1 for p in ports):
            continue
        held: list[socket.socket] = []
        try:
            for i in range(width):
                t = socket.socket()
                t.bind(("127.0.0.1", base + i))
                held.append(t)
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.bind(("127.0.0.1", base))
            held.append(u)
            ports.append(base)
        except OSError:
            pass
        finally:
            for h in held:
                h.close()
    return ports
