"""Prefill worker: a Ray actor that runs chunked prefill and streams KV per chunk to decode workers."""
