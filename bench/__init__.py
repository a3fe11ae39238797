"""Benchmarks: client-side metrics, workloads, reports, and the step-time simulator (``bench.sim``)."""

from __future__ import annotations
