"""Protocol buffer definitions and their generated modules (regenerate with ``python proto/generate.py``)."""
