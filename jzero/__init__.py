"""jzero: DeepSpeed's ZeRO rebuilt natively for JAX/XLA."""
