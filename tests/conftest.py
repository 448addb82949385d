"""Shared pytest configuration for gossiprec's tests.

Deliberately minimal: each test module builds its own fixtures next to the tests that use them (the
virtual-clock pump lives in ``test_membership.py``, the codec strategies in ``test_wire.py``), and no
global Hypothesis profile is loaded, so every property test states its own example budget. The one
shared fixture is ``netns_ok``, which the modules that build network namespaces depend on.
"""

from tests.support.netns import netns_ok  # noqa: F401 (a fixture, shared by the netns modules)
