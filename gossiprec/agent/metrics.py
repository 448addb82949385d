"""Prometheus metrics of one agent (optional: needs ``prometheus-client``, the ``metrics`` extra).

Theory of operation
-------------------
Two kinds of figures, kept apart:

- *State read at scrape time* by a custom collector from the agent's ``control_status()`` (the same
  dict the ``status`` control op returns), so nothing is copied on the hot path: live and known
  members, epoch, health score, fenced, leaving (gauges); packets refused by reason, transport, machine,
  agent and control-socket counters (counters; they only grow within a process).
- *Events* the agent's :class:`~gossiprec.agent.hub.EventHub` publishes, followed by one task
  (:meth:`AgentMetrics.follow`) in the agent's TaskGroup: views installed, alerts this node raised,
  fences (counters), and two histograms:

  ``gossiprec_detection_seconds{reason}``: for each alert this node raises, the time since its first
  evidence against the subject: the first failed probe after the last good one, or the first SWIM
  suspect/failed/left event, whichever came first. Alerts with no such evidence (hangs) are not
  observed.

  ``gossiprec_agreement_seconds``: for each installed view that removes members, the time since this
  node's first evidence against any of them (an alert it raised, or a SWIM failed/left event). It is
  detection plus dissemination plus settling plus consensus, as seen from this node; nodes that never
  saw evidence of their own (the view arrived before any rumour) observe nothing.

Times are the events' own ``at`` stamps (the agent's monotonic clock), so the follower's delay does
not enter the figures.

The HTTP endpoint is a minimal asyncio server (:class:`MetricsServer`, ``GET /metrics``), on the agent's
event loop: scrapes read agent state on the same thread that mutates it, there is no extra thread, and
the socket closes with the agent. Requests are bounded (8 KiB of headers, 5 s, 16 at once); when all 16
are taken, a new request evicts the oldest one still sending its headers (slow clients cannot blind
the scraper), and is refused only when all 16 are being answered. The exposition is rendered at most
once per ``cache_s`` (1 s) and served from that copy in between, so a scrape storm costs the agent
copies, not collections. The endpoint listens on ``--metrics-bind``, by default the agent's own
address (never every interface unless asked; see ``AgentSettings.metrics_host``).

If ``prometheus-client`` is missing, :func:`require_prometheus` raises :class:`ConfigError`; it is
imported only when an endpoint is asked for (``--metrics-port``).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack
from typing import Any, Callable, Iterator, Mapping, Protocol, cast

from gossiprec.errors import ConfigError

log = logging.getLogger(__name__)

TIME_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
"""Histogram buckets for detection and agreement (seconds): the lan goals are 0.3 s and 2 s."""
MAX_HEADER = 8192
REQUEST_TIMEOUT = 5.0
MAX_CONNECTIONS = 16


def require_prometheus() -> Any:
    """The ``prometheus_client`` module, or a ConfigError saying how to get it."""
    try:
        import prometheus_client
        import prometheus_client.core  # noqa: F401  (the custom-collector metric families)
    except ImportError:
        raise ConfigError("a metrics port is set (--metrics-port / GOSSIPREC_METRICS_PORT) but "
                          "prometheus-client is not installed: `pip install 'gossiprec[metrics]'` "
                          "(or prometheus-client), or unset the metrics port") from None
    return prometheus_client


class StatusSource(Protocol):
    """What the collector reads: the agent's ``status`` control op."""

    def control_status(self) -> dict[str, Any]: ...


class EventFollower(Protocol):
    """What :meth:`AgentMetrics.follow` needs: the agent's event hub."""

    def subscribe(self, maxsize: int = ...) -> Any: ...


class _StateCollector:
    """Reads the agent's status at scrape time (a prometheus-client custom collector)."""

    def __init__(self, source: StatusSource, prom: Any) -> None:
        self.source = source
        self._core = prom.core

    def describe(self) -> list[Any]:
        return []  # no describe-time call into the agent

    def collect(self) -> Iterator[Any]:
        core = self._core
        try:
            st = self.source.control_status()
        except Exception:  # the agent is starting or closing: serve what the events gave
            log.debug("status unavailable for metrics", exc_info=True)
            return
        view = st.get("view") or None

        def gauge(name: str, doc: str, value: Any) -> Any:
            g = core.GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            return g

        yield gauge("gossiprec_live_members", "Members this agent holds alive (including itself).",
                    st.get("live") or 0)
        yield gauge("gossiprec_known_members", "Members this agent knows, in any state.", st.get("known") or 0)
        yield gauge("gossiprec_epoch", "Epoch of the installed view (-1: none yet).",
                    view["epoch"] if view else -1)
        yield gauge("gossiprec_view_members", "Members of the installed view.",
                    len(view["members"]) if view else 0)
        health = st.get("health")
        yield gauge("gossiprec_health_score", "Lifeguard local health score (0 = healthy; probe timeouts "
                    "scale by score + 1).", health if isinstance(health, (int, float)) else 0)
        yield gauge("gossiprec_fenced", "1 while this member is fenced (its trainer must not act).",
                    1 if st.get("fenced") else 0)
        yield gauge("gossiprec_leaving", "1 while this agent leaves the cluster.", 1 if st.get("leaving") else 0)
        transport = st.get("transport") or {}
        ranks = {m.get("node"): m.get("rank") for m in (view["members"] if view else ())}
        wait = core.GaugeMetricFamily("gossiprec_collective_wait_ms", "Mean milliseconds per step this agent's "
                                      "trainer waits inside its collectives (its last few steps).", labels=["rank"])
        me = ranks.get(st.get("node"))
        if isinstance(me, int) and me >= 0:
            wait.add_metric([str(me)], float(st.get("wait_ms") or 0))
        yield wait
        behind = core.GaugeMetricFamily("gossiprec_straggler_behind_ms", "Milliseconds per step the other ranks "
                                        "wait for this rank (straggler magnitude), for the ranks this agent "
                                        "judges.", labels=["rank"])
        for node, ms in sorted((st.get("behind") or {}).items()):
            rank = ranks.get(node)
            if isinstance(rank, int) and rank >= 0 and isinstance(ms, (int, float)):
                behind.add_metric([str(rank)], float(ms))
        yield behind
        yield from _counter_family(core, "gossiprec_packets_rejected", "Packets and frames refused, by reason.",
                                   "reason", transport.get("rejects") or {})
        yield from _counter_family(core, "gossiprec_transport_events", "Transport counters by kind.",
                                   "kind", transport.get("counters") or {})
        yield from _counter_family(core, "gossiprec_machine_events", "Protocol machine counters by kind.",
                                   "kind", st.get("machine") or {})
        yield from _counter_family(core, "gossiprec_agent_events", "Agent counters by kind.",
                                   "kind", st.get("agent") or {})
        yield from _counter_family(core, "gossiprec_control_events", "Control socket counters by kind.",
                                   "kind", st.get("control") or {})


def _counter_family(core: Any, name: str, doc: str, label: str, values: Mapping[str, Any]) -> Iterator[Any]:
    fam = core.CounterMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        if isinstance(value, (int, float)):
            fam.add_metric([str(key)], float(value))
    yield fam


class AgentMetrics:
    """The metrics of one agent in a private registry. :meth:`observe` takes machine events."""

    def __init__(self, source: StatusSource | None = None, *, buckets: tuple[float, ...] = TIME_BUCKETS) -> None:
        prom = require_prometheus()
        self._prom = prom
        self.registry = prom.CollectorRegistry(auto_describe=False)
        reg = self.registry
        self.views_installed = prom.Counter(
            "gossiprec_views_installed", "Views this agent installed after view 0.", ["fast"], registry=reg)
        self.alerts_raised = prom.Counter(
            "gossiprec_alerts_raised", "Alerts this node raised as an observer, by reason.", ["reason"],
            registry=reg)
        self.fences = prom.Counter("gossiprec_fences", "Times this member fenced itself.", registry=reg)
        self.unfences = prom.Counter("gossiprec_unfences", "Times this member was readmitted after a fence.",
                                     registry=reg)
        self.detection = prom.Histogram(
            "gossiprec_detection_seconds", "From this node's first evidence against a subject to its alert.",
            ["reason"], buckets=buckets, registry=reg)
        self.agreement = prom.Histogram(
            "gossiprec_agreement_seconds", "From this node's first evidence against a removed member to "
            "the view without it.", buckets=buckets, registry=reg)
        self.straggler_reports = prom.Counter(
            "gossiprec_straggler_reports", "Straggler episodes this agent reported (one per episode per "
            "subject).", registry=reg)
        self.events_lost = prom.Counter(
            "gossiprec_metrics_events_lost", "Event subscriptions of the metrics follower that overflowed.",
            registry=reg)
        if source is not None:
            reg.register(_StateCollector(source, prom))
        self._fail_since: dict[str, float] = {}
        self._trouble: dict[str, float] = {}
        self.observers: list[Callable[[Any], None]] = []
        """Told of every event :meth:`observe` gets (the recoveries' hang count)."""

    # ------------------------------------------------------------------ events
    def observe(self, ev: Any) -> None:
        """Account one machine event (unknown kinds are ignored)."""
        for observer in self.observers:
            observer(ev)
        kind = type(ev).__name__
        at = getattr(ev, "at", None)
        # (the kinds whose ``at`` is kept below all carry ``at: float``: the casts only tell mypy)
        if kind == "ProbeResult":
            if ev.ok:
                self._fail_since.pop(ev.target, None)
            else:
                self._fail_since.setdefault(ev.target, cast(float, at))
        elif kind in ("MemberSuspected", "MemberFailed", "MemberLeft"):
            self._fail_since.setdefault(ev.name, cast(float, at))
            if kind != "MemberSuspected":
                self._trouble.setdefault(ev.name, cast(float, at))
        elif kind == "MemberAlive":
            self._fail_since.pop(ev.name, None)
            self._trouble.pop(ev.name, None)
        elif kind == "AlertRaised":
            self.alerts_raised.labels(reason=ev.reason).inc()
            start = self._fail_since.pop(ev.subject, None)
            if start is not None and at is not None:
                self.detection.labels(reason=ev.reason).observe(max(0.0, at - start))
            self._trouble.setdefault(ev.subject, cast(float, at))
        elif kind == "ViewInstalled":
            self.views_installed.labels(fast=str(bool(ev.fast)).lower()).inc()
            starts = [self._trouble.pop(n) for n in ev.removed if n in self._trouble]
            if starts and at is not None:
                self.agreement.observe(max(0.0, at - min(starts)))
            members = set(ev.members)
            for name in [n for n in self._trouble if n not in members]:
                del self._trouble[name]  # removed by a view we learned without the removal (catch-up)
            for name in [n for n in self._fail_since if n not in members]:
                del self._fail_since[name]  # bounded by the view's size
        elif kind == "Fenced":
            self.fences.inc()
        elif kind == "Straggler":
            self.straggler_reports.inc()
        elif kind == "Unfenced":
            self.unfences.inc()

    async def follow(self, agent: EventFollower) -> None:
        """Observe the agent's events until its hub closes (resubscribing after an overflow)."""
        while True:
            sub = agent.subscribe()
            while True:
                ev = await sub.get()
                if ev is None:
                    break
                self.observe(ev)
            if not getattr(sub, "overflowed", False):
                return
            self.events_lost.inc()
            status = getattr(agent, "control_status", None)
            if status is not None and status().get("state") in ("closing", "closed", "aborted"):
                return  # a new subscription would outlive the hub

    # ------------------------------------------------------------------ exposition
    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of the text format."""
        prom = self._prom
        return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST


class MetricsServer:
    """``GET /metrics`` over HTTP/1.0-style one-shot connections, on the running event loop."""

    def __init__(self, metrics: AgentMetrics, host: str, port: int, *, cache_s: float = 1.0) -> None:
        self.metrics = metrics
        self.host = host
        self.requested_port = port
        self.port = 0
        self.cache_s = cache_s
        self.counters: dict[str, int] = {}
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task[Any]] = set()
        self._reading: dict[asyncio.Task[Any], None] = {}
        """Requests still sending their headers, oldest first."""
        self._cache: tuple[float, bytes, str] | None = None

    async def __aenter__(self) -> MetricsServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.requested_port,
                                                      limit=MAX_HEADER, reuse_address=True)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {self.host}:{self.requested_port}: "
                              f"{exc.strerror or exc}; choose another --metrics-port") from None
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("metrics endpoint on http://%s:%d/metrics", self.host, self.port)

    async def aclose(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._conns) >= MAX_CONNECTIONS:
            if not self._reading:
                self._count("refused")
                writer.close()
                return
            slow = next(iter(self._reading))
            self._reading.pop(slow)
            self._conns.discard(slow)
            slow.cancel()
            self._count("evicted")
        self._conns.add(task)
        self._reading[task] = None
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
                self._reading.pop(task, None)
                parts = head.split(b"\r\n", 1)[0].split()
                if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
                    await self._respond(writer, 400, b"bad request\n", "text/plain")
                elif parts[0] not in (b"GET", b"HEAD"):
                    await self._respond(writer, 405, b"only GET\n", "text/plain")
                elif parts[1].split(b"?", 1)[0] not in (b"/metrics", b"/"):
                    await self._respond(writer, 404, b"see /metrics\n", "text/plain")
                else:
                    body, ctype = self._exposition()
                    self._count("scrapes")
                    await self._respond(writer, 200, b"" if parts[0] == b"HEAD" else body, ctype,
                                        length=len(body))
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError, ValueError):
            self._count("bad_requests")
        except Exception:  # a bug must not take the agent down with one scrape
            self._count("errors")
            log.exception("metrics request failed")
        finally:
            self._conns.discard(task)
            self._reading.pop(task, None)
            writer.close()

    def _exposition(self) -> tuple[bytes, str]:
        now = asyncio.get_running_loop().time()
        cached = self._cache
        if cached is not None and now - cached[0] < self.cache_s:
            self._count("cached")
            return cached[1], cached[2]
        body, ctype = self.metrics.exposition()
        self._cache = (now, body, ctype)
        return body, ctype

    @staticmethod
    async def _respond(writer: asyncio.StreamWriter, code: int, body: bytes, ctype: str,
                       length: int | None = None) -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}[code]
        head = (f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body) if length is None else length}\r\nConnection: close\r\n\r\n")
        writer.write(head.encode("ascii") + body)
        await writer.drain()

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1


class _Agent(StatusSource, EventFollower, Protocol):
    settings: Any


async def serve_agent_metrics(agent: _Agent, stack: AsyncExitStack, tg: asyncio.TaskGroup) -> MetricsServer:
    """The agent's hook: serve ``agent``'s metrics on ``settings.metrics_port`` (host:
    ``settings.metrics_host(agent.addr)``) until ``stack`` closes; the event follower runs in ``tg``.
    Returns the server (``.port``, ``.metrics``)."""
    s = agent.settings
    metrics = AgentMetrics(agent)
    recoveries = getattr(agent, "recoveries", None)
    if recoveries is not None:  # the trainer's recoveries and steps (gossiprec.agent.recoveries)
        recoveries.attach(metrics._prom, metrics.registry)
        metrics.observers.append(recoveries.observe)
    server = MetricsServer(metrics, s.metrics_host(getattr(agent, "addr", None)), s.metrics_port)
    await stack.enter_async_context(server)
    tg.create_task(metrics.follow(agent), name="gossiprec-metrics")
    return server
