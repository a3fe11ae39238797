"""The explorer: a web page showing the schedulers at work, in the simulator and in a live deployment.

``pdserve sim --serve`` serves the playground alone; ``pdserve serve --explorer-port N`` serves the
playground and the live view from router 0's process (``app.add_explorer``).
"""
