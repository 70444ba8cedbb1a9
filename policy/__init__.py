"""Layer 2: the Mixture-of-Experts policy, tokenizer, coding task family, RL losses, routing
replay, trainer, checkpoints, and the versioned weight store with bit-exact deltas."""
