"""Benchmarks of the simulator, built on its public API (never imported by fedora_jax):
measure.py (round timing, FLOPs, peaks, memory), torch_loop.py (the sequential PyTorch
baseline), vmap_vs_map.py. The command is `python -m experiments.benchmark`."""
