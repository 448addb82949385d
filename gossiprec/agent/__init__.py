"""The agent daemon: the asyncio pump around the sans-IO core, its network transport, settings and job
spec, the launcher (``gossiprec run``), metrics and the operator commands."""
