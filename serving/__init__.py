"""Layer 3: engine backends behind one HTTP contract (vLLM and the CPU reference engine), the
fleet registry, the gateway that serves users and emits telemetry, and delta deployment."""
