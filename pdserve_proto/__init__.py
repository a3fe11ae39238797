"""Protocol buffer definitions and their generated modules (regenerate with ``python pdserve_proto/generate.py``)."""
