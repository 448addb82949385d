"""Shared pytest configuration for gossiprec's tests.

Deliberately minimal: each test module builds its own fixtures next to the tests that use them (the
virtual-clock pump lives in ``test_membership.py``, the codec strategies in ``test_wire.py``), and no
global Hypothesis profile is loaded, so every property test states its own example budget. The shared
fixtures are ``netns_ok``, which the modules that build network namespaces depend on, ``ref_dir``,
where the sharded jobs' failure-free references run once per session, and ``gpt_reference``, the
example GPT's failure-free run.

The agents the tests start (``gossiprec run`` and ``gossiprec agent`` in the tests' working directory)
write no timeline file unless a test asks for one: ``GOSSIPREC_TIMELINE`` is ``-`` by default here.
"""

import os

os.environ.setdefault("GOSSIPREC_TIMELINE", "-")

from tests.support.netns import netns_ok  # noqa: F401, E402 (a fixture, shared by the netns modules)
from tests.support.sharded import ref_dir  # noqa: F401, E402 (a fixture: the sharded jobs' failure-free runs)
from tests.support.gpt import gpt_reference  # noqa: F401, E402 (a fixture: examples/gpt_hsdp.py's failure-free run)
