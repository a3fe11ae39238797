"""The stream interval's settings: the deployment's (``pdserve serve --stream-interval``) and the client's."""

from __future__ import annotations

import pytest

from pdserve.cli.main import build_parser, deployment_config_from_args
from pdserve.router.client import _request
from pdserve.router.config import RouterConfig


def test_serve_passes_the_stream_interval_to_every_router():
    args = build_parser().parse_args(["serve", "--stream-interval", "4"])
    assert deployment_config_from_args(args).router_config().stream_interval == 4
    default = build_parser().parse_args(["serve"])
    assert deployment_config_from_args(default).router_config().stream_interval == 1


def test_the_client_sends_the_requests_interval_and_refuses_a_negative_one():
    assert _request([1, 2], None, None, None, 8).stream_interval == 8
    assert _request("hi", None, None, None).stream_interval == 0  # the deployment's
    with pytest.raises(ValueError, match="stream_interval"):
        _request([1], None, None, None, -1)
    with pytest.raises(ValueError, match="stream_interval"):
        RouterConfig(stream_interval=0)
