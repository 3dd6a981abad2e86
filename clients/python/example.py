#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Example: route a request through `kvmatch serve`, report its lifecycle, and pipeline a few more.

    python example.py [ADDRESS [POOL]]
        ADDRESS  unix:/path/to/socket (default unix:/tmp/kvmatch.sock) or tcp:127.0.0.1:PORT
        POOL     the pool to route in (default "default"), with at least one worker, e.g.
                 `kvmatch serve --pool default:16 --worker default:0 --worker default:1`

Runs under any Python where the package is installed (`pip install ./clients/python`), or from this
folder with msgpack importable. A router would call route() before forwarding a request, then
report DISPATCHED when it sent it to the chosen worker, FIRST_TOKEN on the first streamed token, and
FINISHED with what the stream showed (finish_reason, whether [DONE] was seen, HTTP status,
engine-reported cached tokens). Exits 0 when every step was answered as expected."""

import argparse
import sys
from typing import List

from kvmatch_client import (KM_ERR_NO_HEALTHY_WORKER, Client, KvmatchError, error_name,
                            outcome_from_stream)


def run(address: str, pool: str) -> int:
    with Client.connect(address, timeout=5.0) as client:
        assert client.welcome is not None
        print("connected: kvmatch %s, protocol %d" % (client.welcome["kvmatch_version"],
                                                     client.welcome["protocol"]))
        prompt: List[int] = list(range(1000, 1100))  # token ids of the prompt
        reply = client.route([{"request_id": "example-1", "attempt_id": 0, "pool": pool,
                               "endpoint": "/v1/chat/completions", "tokens": prompt,
                               "expected_output_tokens": 200}])
        d = reply["decisions"][0]
        if d["status"] != 0:
            print("not routed: %s: %s" % (error_name(d["status"]), d.get("message")))
            return 1
        print("chosen_worker %d (chosen_depth %d), owner_worker %s (owner_depth %s), source %s, "
              "policy %s" % (d["chosen_worker"], d.get("chosen_depth", 0), d.get("owner_worker"),
                             d.get("owner_depth"), d["source"], d.get("policy")))

        client.dispatched(decision_id=d["decision_id"], worker=d["chosen_worker"])
        client.first_token(decision_id=d["decision_id"], elapsed_ms=41.5)
        finish_reason, done_seen, http_status = "stop", True, 200
        client.finished(decision_id=d["decision_id"], finish_reason=finish_reason,
                        done_seen=done_seen, http_status=http_status, cached_tokens=96,
                        prompt_tokens=len(prompt), output_tokens=187, retries=0)
        print("outcome reported: %s" % outcome_from_stream(finish_reason, done_seen, http_status))

        # The router's own health checks reach kvmatch: a worker marked unhealthy is never chosen
        # until it is marked healthy again (SERVICE.md, "Worker health").
        worker = d["chosen_worker"]
        for healthy in (False, True):
            ack = client.workers("update", [{"pool": pool, "worker": worker, "healthy": healthy}])
            if ack["items"][0]["status"] != 0:
                print("health update refused: %s" % ack["items"][0].get("message"))
                return 1
            if not healthy:
                only = client.route([{"request_id": "example-down", "pool": pool, "tokens": prompt,
                                      "candidates": [worker]}])["decisions"][0]
                print("worker %d marked unhealthy; a route that allows only it: %s"
                      % (worker, only.get("message")))
                if only["status"] != KM_ERR_NO_HEALTHY_WORKER:
                    return 1

        # Pipelined: many requests in flight on one connection, replies matched by id.
        ids = [client.send_route([{"request_id": "example-p%d" % i, "pool": pool,
                                   "tokens": prompt[: 16 * (i + 1)]}])
               for i in range(4)]
        for rid in ids:
            print("request %d -> chosen_worker %d"
                  % (rid, client.wait(rid)["decisions"][0]["chosen_worker"]))
    return 0


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description="Route through kvmatch serve and report a lifecycle.")
    parser.add_argument("address", nargs="?", default="unix:/tmp/kvmatch.sock",
                        help="unix:/path or tcp:127.0.0.1:PORT (default unix:/tmp/kvmatch.sock)")
    parser.add_argument("pool", nargs="?", default="default", help='the pool (default "default")')
    args = parser.parse_args(argv)
    try:
        return run(args.address, args.pool)
    except (KvmatchError, OSError) as e:
        print("kvmatch: %s" % e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
