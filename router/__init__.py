"""The front door: gRPC server, routing policy, token streaming back to clients, and a Ray- and torch-free client."""
