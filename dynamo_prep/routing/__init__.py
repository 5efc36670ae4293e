"""KV-aware routing: follow every instance's KV-cache events (``subscriber``), index the blocks each
instance holds by the frontend's own hashes, and choose an instance by cached prefix and load."""
