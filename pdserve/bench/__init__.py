"""``pdserve bench``: the A/B benchmark's runner (workloads, metrics and reports come from ``pdserve.workload``)."""

from __future__ import annotations

if __name__ != "pdserve.bench":  # imported under another name (a path entry inside the package)
    raise ImportError(f"import pdserve.bench, not {__name__}: pdserve's parts have one import name each")
