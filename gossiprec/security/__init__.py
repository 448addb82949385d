"""Security: sealing of every datagram and stream frame (AES-256-GCM, replay window) and the keyring
(keys on disk, live rotation). Used by the agent and by the trainer's state transfers."""
