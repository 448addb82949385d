"""Catching up and joining: how a member that missed decisions, or holds no view yet, gets the current one.

What it decides: which view news to send to whom (the change sets since the asker's view, or the full
view), and which news to install. Inputs: :class:`ViewRequest` from members behind us or joiners,
:class:`ViewDelta` and :class:`ViewState` answering ours, :class:`JoinRequest` from joiners, and alerts
of an older epoch (their sender missed a decision).

- A member that hears of a later epoch asks two members SWIM holds alive (at most once per
  ``catchup_interval``). The answer replays the agreed change sets since the asker's view when the
  answerer remembers them all (the last ``MAX_DELTA_STEPS``), else it is the full view. A delta is
  installed only if every step reproduces its config id. A full view that kept an older view's groups
  (a spare joined or left since) goes after that group view, so that the member installs both and
  aggregates the group view's plan, as a delta's member does.
- A member alerting in an older epoch gets the current view pushed to it (by a deterministic
  pseudo-random ~2K members, at most once per ``catchup_interval`` each: O(N) pushes, not O(N^2)); a
  member the decision removed learns so, and asks to join again.
- A member outside the view asks its joiner observers to admit it every ``join_retry``; they alert
  (with signatures on, only once SWIM knows the joiner: a join request is nobody's signed word).
  One removed from the view asks only once its trainer holds no trained state (it dropped it to wait as
  a spare, as a trainer that answers does): a trainer removed as hung cannot answer, and admitting its
  node as a spare would have the next election hand a rank to it (a wasted view change, and a second
  one to remove it again). The launcher kills such a trainer after its grace, and the agent leaves.
- A new process that holds a view listing it (an agent restarted from the job spec holds view 0) says
  :class:`Hello` to its observers for ``hello_for``: a member holding a later view sends its news back
  (the process learns it was removed, and joins again); an observer that had answers from an older
  process of it alerts ``restarted`` (the old process's place is removed, not silently taken over).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

from gossiprec.core import timers
from gossiprec.core.auth import sign_if
from gossiprec.core.config import AgreementConfig
from gossiprec.core.consensus import ChangeRow, changes_from_rows
from gossiprec.core.membership import Membership
from gossiprec.core.observer import Observer
from gossiprec.core.port import NodePort
from gossiprec.core.view import JOIN, REMOVE, View, changes_digest
from gossiprec.core.wire import ALIVE, MAX_DELTA_STEPS, Hello, JoinRequest, ViewDelta, ViewRequest, ViewState
from gossiprec.errors import ConfigError, ProtocolError


JOIN_PUSHPULL_EVERY = 4
"""A joiner not admitted yet sends its join push-pull again every this many rounds of join requests."""


class CatchUp:
    """The catch-up and join part of one :class:`~gossiprec.core.node.Node`."""

    __slots__ = ("node", "swim", "observer", "acfg", "hello_until", "history", "last_catchup", "pushed_view",
                 "outsider_window", "_state", "after_removal", "join_asks", "_group_view", "_group_state")

    def __init__(self, node: NodePort, swim: Membership, observer: Observer, acfg: AgreementConfig,
                 now: float, group_view: Callable[[], View | None] = lambda: None) -> None:
        self.node = node
        self._group_view = group_view
        """The group view this node aggregates (``Aggregates.view``): what a full view that kept its groups
        is sent with (see :meth:`send_news`)."""
        self.swim = swim
        self.observer = observer
        self.acfg = acfg
        self.hello_until = now + acfg.hello_for
        """Until then this process says hello to its observers (see :meth:`hello`)."""
        self.history: dict[tuple[int, str], tuple[str, tuple[ChangeRow, ...]]] = {}
        """(epoch, config id) of a view we held -> (config id of its successor, the agreed change rows):
        what a :class:`ViewDelta` replays for a member still holding that view (last few only)."""
        self.last_catchup = float("-inf")
        self.pushed_view: dict[str, float] = {}
        """Member -> when we last pushed it the current view (reset with every view)."""
        self.outsider_window = (float("-inf"), 0)
        """(start, count) of the current catchup_interval's pushes to names outside the view."""
        self._state: ViewState | None = None
        """Our signed full view, made once per view."""
        self._group_state: ViewState | None = None
        """Our signed full group view (see :meth:`group_state`), made once per group view."""
        self.after_removal = False
        """This member was removed from a view it held (not as a new process): it rejoins only once its
        trainer dropped its state (see the module notes)."""
        self.join_asks = 0
        """Rounds of join requests sent since this process started (see :meth:`join_retry`)."""

    def start_view(self) -> None:
        self.pushed_view = {}

    def _may_push(self, who: str, v: View, now: float) -> bool:
        """Whether ``who`` may be sent our view now, and if so note it. Each name at most once per
        catchup_interval; names outside the view (a Hello names its sender and its address freely, so
        a key holder could make us send views to any address under ever new names) at most one per
        member of the view and a few more per interval in all, and their entries do not outlive it."""
        interval = self.acfg.catchup_interval
        if now - self.pushed_view.get(who, float("-inf")) < interval:
            return False
        if who not in v:
            start, count = self.outsider_window
            if now - start >= interval:
                start, count = now, 0
                self.pushed_view = {m: t for m, t in self.pushed_view.items() if m in v or now - t < interval}
            if count >= len(v) + 8:
                return False
            self.outsider_window = (start, count + 1)
        self.pushed_view[who] = now
        return True

    # ------------------------------------------------------------------ asking
    def catch_up(self, now: float) -> None:
        node = self.node
        if now - self.last_catchup < self.acfg.catchup_interval or node.view is None:
            return
        self.last_catchup = now
        # ask two members that SWIM holds alive (a random pick could be the very member that failed);
        # random draws, not a scan of the view: O(1) per catch-up, not O(N)
        members = node.view.members
        asked: set[str] = set()
        for _ in range(4 * len(members) if len(members) <= 16 else 32):
            m = members[node.rng.randrange(0, len(members))]
            if m.node == node.name or m.node in asked:
                continue
            rec = self.swim.member(m.node)
            if rec is None or rec.status != ALIVE:
                continue
            asked.add(m.node)
            self.swim.send_addr(rec.addr, self.view_request())
            if len(asked) == 2:
                break

    def view_request(self) -> ViewRequest:
        node = self.node
        v = node.view
        return ViewRequest(v.epoch if v else 0, v.config_id if v else "", node.name, node.addr)

    # ------------------------------------------------------------------ answering
    def remember(self, old: View, new: View, rows: tuple[ChangeRow, ...]) -> None:
        self.history[(old.epoch, old.config_id)] = (new.config_id, rows)
        while len(self.history) > MAX_DELTA_STEPS:
            del self.history[next(iter(self.history))]

    def view_news(self, epoch: int, config: str) -> ViewDelta | ViewState:
        """What brings a member holding view (epoch, config) up to ours: the change sets since, when we
        remember them all, else the full view."""
        v = self.node.view
        assert v is not None
        steps = []
        key = (epoch, config)
        while key != (v.epoch, v.config_id):
            step = self.history.get(key)
            if step is None:
                return self.view_state()
            steps.append(step)
            key = (key[0] + 1, step[0])
        delta = ViewDelta(epoch, config, tuple(steps), self.node.name)
        auth = self.node.auth
        return delta if auth is None else auth.sign(delta)  # type: ignore[return-value]

    def view_state(self) -> ViewState:
        """Our view, whole, from us (signed where the cluster signs; made once per view)."""
        v = self.node.view
        assert v is not None
        self._state = self._signed(v, self._state)
        return self._state

    def group_state(self) -> ViewState | None:
        """Our signed full group view, when our view kept an older view's groups and we hold that view."""
        v, g = self.node.view, self._group_view()
        if v is None or g is None or v.group_epoch == v.epoch or g.epoch != v.group_epoch:
            return None
        self._group_state = self._signed(g, self._group_state)
        return self._group_state

    def _signed(self, v: View, made: ViewState | None) -> ViewState:
        """View ``v`` whole, from us, signed where the cluster signs: ``made`` again when it is that view's."""
        wire = self.view_wire(v)
        if made is not None and made.view is wire:
            return made
        st = ViewState(wire, self.node.name)
        if self.node.auth is not None:
            self.node.auth.sign(st)
        return st

    def send_news(self, addr: str, msg: ViewDelta | ViewState, *, group: bool = True) -> None:
        """View news on the stream, our key claim ahead of it (see :meth:`NodePort.key_claim`). A full view
        that kept an older view's groups goes after that group view, in the same message (``group``: to a
        member, which may hold a rank in it; a joiner holds none): installing both in turn, the member
        reports to the group view's plan and aggregates it (its trainer waits for that plan), as the
        members that installed the group view do. (A delta carries the group view's changes already.)"""
        before = self.node.key_claim()
        if group and isinstance(msg, ViewState) and (g := self.group_state()) is not None:
            before = (*before, g)
        self.swim.send_addr(addr, msg, reliable=True, before=before)

    def trusted(self, msg: ViewDelta | ViewState, offered: View | None) -> bool:
        """Whether view news may be installed: with signatures on, only from a member of the view we
        hold (with none yet: of the view offered), in its own signed word."""
        node = self.node
        if node.auth is None:
            return True
        held = node.view if node.view is not None else offered
        if held is None or msg.src not in held or not node.auth.check(msg.src, msg):
            node.counters["rx_view_untrusted"] = node.counters.get("rx_view_untrusted", 0) + 1
            return False
        return True

    def _spec_claim(self, author: str, msg: ViewState | Hello) -> bool:
        """Whether another view 0 may fence us (for good): with signatures on, only in the signed word of
        a member of the view 0 we hold. A key holder could otherwise sign one under a fresh name (its key
        bound on first use) and stop this agent with one datagram. An agent outside our view 0 that read
        another spec is reported (the event), not obeyed: it cannot take part in our agreement anyway,
        and it refuses ours on its side (our view 0 goes back to it)."""
        node = self.node
        v = node.view
        if node.auth is None:
            return True
        return v is not None and author in v and node.auth.check(author, msg)

    def push_view(self, member: str, epoch: int, config: str, now: float) -> None:
        """A member still alerting in an older epoch missed the decision: send it the current view (at
        most once per ``catchup_interval`` per member). Also when the decision removed it (a healed
        minority): it learns it is out, and asks to join again."""
        node = self.node
        v = node.view
        if v is None or member == node.name:
            return
        # Stale alerts are gossiped to everyone; if everyone pushed an O(N) view to each stale sender,
        # a large view change would cost O(N^2). A deterministic pseudo-random ~2K members push.
        pushers = 2 * self.acfg.k
        if len(v) > pushers and hashlib.blake2b(f"{member}|{node.name}".encode(), digest_size=4).digest()[0] \
                * len(v) >= pushers * 256:
            return
        if not self._may_push(member, v, now):
            return
        rec = self.swim.member(member)
        if rec is not None and rec.addr:
            self.send_news(rec.addr, self.view_news(epoch, config))

    def view_wire(self, v: View) -> list[Any]:
        """The wire form of a view, built once per view (shared through the memo)."""
        memo = self.node.memo
        key = ("wire", v.config_id)
        w = memo.get(key)
        if w is None:
            w = memo[key] = v.to_wire()
        return w

    def on_view_request(self, msg: ViewRequest, now: float) -> None:
        v = self.node.view
        if v is not None and (v.epoch > msg.epoch or (v.epoch == msg.epoch and v.config_id != msg.config)):
            # (a joiner sends an empty config: no history matches it, so it gets the full view)
            self.send_news(msg.src_addr, self.view_news(msg.epoch, msg.config))

    # ------------------------------------------------------------------ installing news
    def on_view_delta(self, msg: ViewDelta, now: float) -> None:
        node = self.node
        v = node.view
        counters = node.counters
        if v is None or msg.epoch != v.epoch or msg.config != v.config_id or not msg.steps:
            counters["rx_stale_view"] = counters.get("rx_stale_view", 0) + 1
            return
        if node.spec_conflict:  # fenced for good, out of agreement: no view news either
            counters["rx_spec_conflict"] = counters.get("rx_spec_conflict", 0) + 1
            return
        if not self.trusted(msg, None):
            return
        views = [v]
        steps: list[list[Any]] = []
        for config, rows in msg.steps:
            prev = views[-1]
            changes = changes_from_rows(rows)
            nv: View | None
            try:
                nv = node.next_view(prev, changes_digest(prev.epoch, prev.config_id, changes), changes)
            except (ProtocolError, ConfigError, ValueError):
                nv = None
            if nv is None or nv.config_id != config:
                counters["rx_bad_view"] = counters.get("rx_bad_view", 0) + 1
                return
            views.append(nv)
            steps.append(changes)
        for (_, rows), old, new in zip(msg.steps, views, views[1:]):
            self.remember(old, new, rows)
        last = views[-1]
        # the last view's group view among those skipped is installed first, so that this member reports to
        # its plan and aggregates it (the last view keeps it), as every member that installed it does
        group = [i for i in range(1, len(views) - 1) if views[i].epoch == last.group_epoch]
        for i in (*group, len(views) - 1):
            at = node.view
            if at is not None and at.epoch >= views[i].epoch:
                continue  # (an install moved this member on already: an early decision it replayed)
            changes = steps[i - 1]
            node.install(views[i], now, fast=False, decided_here=False,
                         removed=tuple(c.node for c in changes if c.kind == REMOVE),
                         joined=tuple(c.node for c in changes if c.kind == JOIN))

    def on_view_state(self, msg: ViewState, now: float) -> None:
        node = self.node
        counters = node.counters
        epoch = msg.view[0] if isinstance(msg.view, (list, tuple)) and msg.view else None
        if node.view is not None and node.view.epoch == 0 and epoch == 0:
            try:
                other = View.from_wire(msg.view)
            except ProtocolError:
                counters["rx_bad_view"] = counters.get("rx_bad_view", 0) + 1
                return
            if other.config_id != node.view.config_id:  # a ViewState names no peer (its Hello does)
                node.spec_mismatch("", other.config_id, other, now, proven=self._spec_claim(msg.src, msg))
            return
        if node.spec_conflict:  # fenced for good, out of agreement: no view news either
            counters["rx_spec_conflict"] = counters.get("rx_spec_conflict", 0) + 1
            return
        if node.view is not None and type(epoch) is int and epoch <= node.view.epoch:
            counters["rx_stale_view"] = counters.get("rx_stale_view", 0) + 1
            return  # not news: skip the O(N) parse (after a change many members push the same view)
        try:
            view = View.from_wire(msg.view)
        except ProtocolError:
            counters["rx_bad_view"] = counters.get("rx_bad_view", 0) + 1
            return
        if (node.view is None or view.epoch > node.view.epoch) and self.trusted(msg, view):
            node.install(view, now, fast=False, decided_here=False, removed=(), joined=())

    # ------------------------------------------------------------------ joining
    def join_retry(self, now: float) -> None:
        node = self.node
        v = node.view
        if v is not None and node.name in v:
            return
        node.set_timer(now + self.acfg.join_retry, timers.JOIN)
        if v is None:
            return
        if self.after_removal:
            committed, _, size = node.trainer_state
            if committed > 0 and size > 0:  # the trainer has not answered its removal (yet)
                node.counters["join_held_for_trainer"] = node.counters.get("join_held_for_trainer", 0) + 1
                return
            self.after_removal = False
        observers = [m for obs in node.overlay(v).joiner_observers(node.name) if (m := v.member(obs)) is not None]
        for m in observers:
            self.swim.send_addr(m.addr, JoinRequest(node.name, node.addr, node.host, node.rack, v.epoch))
        self.join_asks += 1
        if observers and self.join_asks % JOIN_PUSHPULL_EVERY == 0:
            # With signatures, a joiner that SWIM does not know is not admitted (a join request is nobody's
            # signed word), and SWIM learns it from its join push-pull, sent once: lost, or come before a
            # seed held a view (an extra candidate of the bootstrap, say), it waits for the periodic
            # anti-entropy (tens of seconds). So it goes again, to one joiner observer at a time.
            self.swim.join([observers[self.join_asks // JOIN_PUSHPULL_EVERY % len(observers)].addr], now)

    def on_join_request(self, msg: JoinRequest, now: float) -> None:
        node = self.node
        v = node.view
        if v is None or node.name not in v:
            return
        if msg.epoch != v.epoch or msg.node in v:
            self.send_news(msg.addr, self.view_state(), group=False)  # a joiner: all of it
            return
        self.observer.joining(msg, node.overlay(v), now)

    # ------------------------------------------------------------------ a new process
    def hello(self, now: float, seeds: tuple[str, ...] = ()) -> None:
        """Within ``hello_for`` of this process's start, and while it holds a view that lists it: tell its
        observers in that view (and ``seeds``) that this process started; again every ``join_retry``."""
        node = self.node
        if now >= self.hello_until:
            return
        node.set_timer(now + self.acfg.join_retry, timers.HELLO)
        v = node.view
        if v is None or node.name not in v:
            return
        if now > self.hello_until - self.acfg.hello_for:
            # no news came back from the first Hellos: also ask two members SWIM holds alive (the
            # observers this view names may all be gone, for a restart from the job spec holds view 0, or
            # every Hello was lost); a job's first start, all on view 0, asks nobody at once
            self.catch_up(now)
        ov = node.overlay(v)
        msg = sign_if(node.auth, Hello(node.name, node.addr, node.start_incarnation, v.epoch, v.config_id))
        for name in dict.fromkeys(ov.observers(node.name) + ov.joiner_observers(node.name)):
            m = v.member(name)
            if m is not None and name != node.name:
                self.swim.send_addr(m.addr, msg, progress=True)
        for addr in seeds:
            if addr != node.addr:
                self.swim.send_addr(addr, msg)

    def on_hello(self, msg: Hello, now: float) -> None:
        node = self.node
        v = node.view
        if v is None or msg.node == node.name:
            return
        if v.epoch == 0 and msg.epoch == 0 and v.config_id != msg.config:
            # two views 0: its agents read another job spec. Both sides refuse; our view 0 and our Hello go
            # back, so that it names the differing members and answers with its own view 0
            node.spec_mismatch(msg.node, msg.config, None, now, proven=self._spec_claim(msg.node, msg))
            if self._may_push(msg.node, v, now):
                self.send_news(msg.addr, self.view_state())
                self.swim.send_addr(msg.addr, sign_if(node.auth, Hello(node.name, node.addr, node.start_incarnation,
                                                                       0, v.config_id)))
            return
        if v.epoch > msg.epoch or (v.epoch == msg.epoch and v.config_id != msg.config):
            # it holds an older view (restarted from the job spec, say): our news, straight back; each of
            # its few observers answers, at most once per catchup_interval
            if self._may_push(msg.node, v, now):
                self.send_news(msg.addr, self.view_news(msg.epoch, msg.config))
        elif msg.epoch > v.epoch:
            self.catch_up(now)
        if node.name in v and msg.node in v and node.name in node.overlay(v).observers(msg.node):
            first = self.swim.first_acked(msg.node)
            auth = node.auth  # a pinned member's restart is its own signed word (another's Hello evicts it)
            if auth is not None and msg.node in auth.pinned and not auth.check(msg.node, msg):
                node.counters["rx_hello_unsigned"] = node.counters.get("rx_hello_unsigned", 0) + 1
            elif first is not None and first < msg.incarnation:
                # we had answers from an older process of it (the Hello names the incarnation its process
                # started at, not the current one, which rises with every refutation): that process (and
                # its trainer's state) is gone, and its place in the view with it; the new one joins as a spare
                self.observer.restarted(msg.node, now)
