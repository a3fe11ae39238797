"""Decode worker: a Ray actor that decodes (and prefills locally) and receives remote KV."""
