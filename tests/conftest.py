"""Shared pytest configuration for gossiprec's tests.

Deliberately minimal: each test module builds its own fixtures next to the tests that use them (the
virtual-clock pump lives in ``test_membership.py``, the codec strategies in ``test_wire.py``), and no
global Hypothesis profile is loaded, so every property test states its own example budget.
"""
