"""Access to the client API: loopback by default, optional TLS and bearer-token auth (real servers)."""

from __future__ import annotations

import ipaddress

import grpc
import psutil
import pytest
from support.certs import make_ca_and_server_cert

from pdserve.deployment import Deployment, DeploymentConfig
from pdserve.engine import EngineConfig, SamplingParams
from pdserve.router.client import Client

pytestmark = pytest.mark.cluster

ENGINE = EngineConfig(model="tiny", device="cpu", num_kv_blocks=64, torch_threads=1, max_model_len=256)
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_the_router_listens_on_loopback_only_by_default(ray_cluster):
    assert DeploymentConfig().host == "127.0.0.1"
    with Deployment(DeploymentConfig(engine=ENGINE)) as d:
        port = int(d.address.rsplit(":", 1)[1])
        pid = d.router_usage()[0]["pid"]
        listening = {c.laddr for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        on_port = [ipaddress.ip_address(addr.ip) for addr in listening if addr.port == port]
        on_port = [getattr(ip, "ipv4_mapped", None) or ip for ip in on_port]  # gRPC binds a dual-stack socket
        assert on_port and all(ip.is_loopback for ip in on_port), listening


def test_a_bearer_token_is_required_when_configured(ray_cluster):
    import openai

    with Deployment(DeploymentConfig(engine=ENGINE, auth_token="s3cret-token", http_port=0)) as d:
        for key in ("wrong-token", "s3cret-token"):
            api = openai.OpenAI(base_url=f"{d.http_url}/v1", api_key=key, max_retries=0, timeout=30)
            if key == "wrong-token":
                with pytest.raises(openai.AuthenticationError):
                    api.completions.create(model="tiny", prompt="hi", max_tokens=2)
            else:
                assert api.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        for token in (None, "wrong-token", "s3cret-token-but-longer"):
            with Client(d.address, auth_token=token) as c:
                for call in (lambda c=c: list(c.generate([1, 2, 3], PARAMS)), c.stats, c.health):
                    with pytest.raises(grpc.RpcError) as err:
                        call()
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(d.address, auth_token="s3cret-token") as c:
            assert len([t for chunk in c.generate([1, 2, 3], PARAMS) for t in chunk.token_ids]) == 4
            assert c.health().ok


def test_tls_serves_clients_that_trust_its_ca_and_nobody_else(ray_cluster, tmp_path):
    ca, cert, key = make_ca_and_server_cert()
    other_ca, _, _ = make_ca_and_server_cert()
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    config = DeploymentConfig(  # disaggregated over gRPC: the KV service speaks TLS with the same certificate
        engine=ENGINE,
        mode="disaggregated",
        transport="grpc",
        verify_kv=True,
        tls_cert_file=str(tmp_path / "cert.pem"),
        tls_key_file=str(tmp_path / "key.pem"),
    )
    with Deployment(config) as d:
        target = d.address.replace("127.0.0.1", "localhost")
        with Client(target, root_certificates=ca) as c:
            chunks = list(c.generate([1, 2, 3], PARAMS))
            assert len([t for chunk in chunks for t in chunk.token_ids]) == 4
            assert chunks[-1].metadata.mode == "disaggregated" and chunks[-1].metadata.kv_transfer_bytes > 0
        for client in (Client(target, timeout_s=5), Client(target, timeout_s=5, root_certificates=other_ca)):
            with client, pytest.raises(grpc.RpcError) as err:
                list(client.generate([1, 2, 3], PARAMS))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
