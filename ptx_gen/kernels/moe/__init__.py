"""Mixture-of-experts kernels: routing and combining the experts' outputs on the device."""
