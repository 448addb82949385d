"""Moving a committed state between ranks over authenticated TCP.

- :mod:`~.wire`: the frames, stripes and seals both sides speak.
- :mod:`~.donor`: the server that hands out byte ranges of this rank's committed state.
- :mod:`~.fetch`: the receiver, striped over several donors, straight into the local tensors.
"""
