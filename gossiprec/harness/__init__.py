"""The local-job harness shared by ``gossiprec demo``, the benchmarks and the end-to-end tests."""
