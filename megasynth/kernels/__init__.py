"""Execution: the PyTorch reference decode step, the CPU executor and the persistent Triton interpreter."""
