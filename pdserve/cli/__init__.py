"""The ``pdserve`` command: serve, generate, demo, bench, sim."""
