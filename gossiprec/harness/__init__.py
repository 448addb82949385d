"""The local-job harness shared by ``gossiprec demo``, the benchmarks and the end-to-end tests.

A local job is one ``gossiprec run`` (agent + trainer child) per node on loopback, all started from one
generated job spec and keyring and all reaped on every path (:mod:`~gossiprec.harness.job`, ports from
:mod:`~gossiprec.harness.ports`). The demo's trainer (:mod:`~gossiprec.harness.trainer`) trains the
demo workload (:mod:`~gossiprec.harness.workload`) and fires faults at chosen phases of chosen steps
(:mod:`~gossiprec.harness.faults`); :mod:`~gossiprec.harness.scenario` runs such a job, checks its
final state against the failure-free run and builds each fault's timeline
(:mod:`~gossiprec.harness.timeline`). Neither the agent nor the trainer library imports any of it.
"""
