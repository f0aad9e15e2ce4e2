"""Benchmarks run by ``python -m recipes.bench suite=<name>``; each returns rows of results."""
