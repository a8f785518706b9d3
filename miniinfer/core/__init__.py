"""Core pieces every layer above builds on: models, sampling, the KV pool, the scheduler, kernels."""
