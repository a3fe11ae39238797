"""Benchmarks: client-side metrics, workloads, reports, and the step-time simulator (``sim``)."""

from __future__ import annotations

if __name__ != "pdserve.bench":  # imported as a top-level `bench` (the repository's link to this folder)
    raise ImportError(f"import pdserve.bench, not {__name__}: pdserve's parts have one import name each")
