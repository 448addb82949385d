"""``gossiprec report``: the recovery timelines an agent writes, read back as a table and a picture.

One concern per module: :mod:`~gossiprec.report.timeline` reads and checks the JSON-lines files,
:mod:`~gossiprec.report.summary` computes the table and the totals, :mod:`~gossiprec.report.plot` draws
them (matplotlib, the ``plot`` extra), :mod:`~gossiprec.report.cli` is the command. The package imports
nothing of gossiprec but :mod:`gossiprec.errors`: it reads files, never an agent.
"""
