"""The front door: gRPC server, routing policy, token streaming back to clients, and a Ray- and torch-free client."""

if __name__ != "pdserve.router":  # imported as a top-level `router` (the repository's link to this folder)
    raise ImportError(f"import pdserve.router, not {__name__}: pdserve's parts have one import name each")
