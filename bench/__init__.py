"""The benchmarks: ours against PyTorch's own, timed side by side."""
