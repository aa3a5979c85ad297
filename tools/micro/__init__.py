"""Micro-benchmarks of the SparQ op and its memory floors (README.md): `python -m tools.micro.<name>`."""
