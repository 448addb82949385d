"""The channel between a trainer and its agent on the same host, used by both processes: the control
socket (requests and the event stream), the progress page (shared memory) and the exit bell."""
