"""Prefill worker: a Ray actor that runs chunked prefill and streams KV per chunk to decode workers."""

if __name__ != "pdserve.prefill_node":  # imported as a top-level `prefill_node` (the repository's link to this folder)
    raise ImportError(f"import pdserve.prefill_node, not {__name__}: pdserve's parts have one import name each")
