"""The agreement machine's timer kinds.

:class:`~gossiprec.core.node.Node` keeps one heap of ``(deadline, token, kind, epoch)``; its parts arm
timers through its port (``NodePort.set_timer(when, kind)``) and the node's ``tick`` runs each kind's
handler. Agreement timers (``EVAL``, ``FALLBACK``, ``RESEND``) belong to the epoch they were armed in and
are dropped once the view has changed; the others run whatever the view.
"""

from __future__ import annotations

EVAL, FALLBACK, RESEND, WATCH, JOIN, HANG, REPORT, HELLO = range(8)
"""Evaluate the cut; fall back to a classic round; re-send the coordinator's phase; the watchdog; ask to
join; an extra hang check; look at the trainer while a state report is held; say hello (a new process)."""

AGREEMENT = frozenset({EVAL, FALLBACK, RESEND})
"""The kinds that belong to one epoch's agreement."""
