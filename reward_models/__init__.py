"""Layer 1: labels from user signals, reward-model training and evaluation, the registry,
retraining triggers, drift and reward-hacking detection."""
