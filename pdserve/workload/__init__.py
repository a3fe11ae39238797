"""Workloads and what they measure, shared by ``pdserve bench`` (real deployments) and ``pdserve sim`` (simulated
ones): request generation (arrivals, lengths, ShareGPT files), per-request metrics, reports and plots."""

from __future__ import annotations

if __name__ != "pdserve.workload":  # imported under another name (a path entry inside the package)
    raise ImportError(f"import pdserve.workload, not {__name__}: pdserve's parts have one import name each")
