"""Benchmarks behind ``computron bench``: each measures its reference in the same run and writes JSON."""
