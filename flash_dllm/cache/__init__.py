"""KV-cache policy and bookkeeping (no torch.cuda here)."""
