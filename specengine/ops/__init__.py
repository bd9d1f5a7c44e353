"""Kernels: the C++ extension loader, linear / norm / RoPE / SwiGLU over it, the thread tuner."""
