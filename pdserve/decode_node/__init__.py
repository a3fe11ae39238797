"""Decode worker: a Ray actor that decodes (and prefills locally) and receives remote KV."""

if __name__ != "pdserve.decode_node":  # imported as a top-level `decode_node` (the repository's link to this folder)
    raise ImportError(f"import pdserve.decode_node, not {__name__}: pdserve's parts have one import name each")
