"""recloop_kernels: sparse-embedding kernels for recommender training (torch + triton only)."""

__version__ = "0.1.0"
