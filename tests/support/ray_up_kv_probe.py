"""Run on the head of the loopback cluster (``ray exec``) by tests/e2e/test_ray_up.py: prints, as one JSON line,
the KV transfer target each named decode worker of the running ``pdserve serve`` advertises and the address
of every alive node as the GCS records it (``NodeManagerAddress``).

    python tests/support/ray_up_kv_probe.py decode-0 [decode-1 ...]
"""

from __future__ import annotations

import json
import sys

import ray

from pdserve.deployment import WORKER_NAMESPACE


def main(worker_ids: list[str]) -> int:
    ray.init(address="auto", log_to_driver=False)
    try:
        nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        workers = {}
        for worker_id in worker_ids:
            actor = ray.get_actor(f"pdserve-{worker_id}", namespace=WORKER_NAMESPACE)
            target = ray.get(actor.transfer_target.remote(), timeout=60)
            node = ray.get(actor.ready.remote(), timeout=60)["node"]
            workers[worker_id] = {"kind": target.kind, "address": target.address, "node": node}
    finally:
        ray.shutdown()
    print("KV-PROBE " + json.dumps({"nodes": nodes, "workers": workers}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
