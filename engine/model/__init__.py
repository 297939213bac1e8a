"""The model's math in model order (the forward pass) and its state (KV, snapshots, bound weights, ds4 numerics)."""
