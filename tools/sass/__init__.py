"""Kernels compiled for sm_90 without a GPU, and what ptxas made of them (tests/kernels/test_*_sass.py,
scripts/frag_sass.py)."""
