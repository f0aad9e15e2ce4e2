"""Triton kernels (GPU; also run by the CPU tests under ``TRITON_INTERPRET=1``)."""
