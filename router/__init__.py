"""The front doors (gRPC, OpenAI-compatible HTTP), routing policy, token streaming, metrics, and a light client."""
