"""The OpenAI-compatible API, laid out as vLLM's: ``protocol`` (request bodies and errors), ``serving`` (what the
generation endpoints share), ``serving_completion``, ``serving_chat`` and ``serving_tokenization`` (one endpoint
family each). The HTTP app that serves them is ``pdserve.router.http_api``."""
