"""Benchmarks: offline tok/s, the serving-load client, profiling, token equality."""
