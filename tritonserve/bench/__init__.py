"""Benchmarks and the protocol tools: throughput, kernels, serve, conformance."""
