#!/usr/bin/env python3
"""Example: route a request through `kvmatch serve`, report its lifecycle, and pipeline a few more.

    python3 clients/python/example.py [unix:/tmp/kvmatch.sock | tcp:127.0.0.1:7070]

A router would call route() before forwarding a request, then report DISPATCHED when it sent it to
the chosen worker, FIRST_TOKEN on the first streamed token, and FINISHED with what the stream
showed (finish_reason, whether [DONE] was seen, HTTP status, engine-reported cached tokens)."""

import sys

from kvmatch_client import Client, KvmatchError, outcome_from_stream


def main(address):
    with Client.connect(address, timeout=5.0) as client:
        print("connected: kvmatch %s, protocol %d" % (client.welcome["kvmatch_version"],
                                                     client.welcome["protocol"]))
        prompt = list(range(1000, 1100))  # token ids of the prompt
        reply = client.route([{"request_id": "example-1", "attempt_id": 0, "pool": "default",
                               "endpoint": "/v1/chat/completions", "tokens": prompt,
                               "expected_output_tokens": 200}])
        d = reply["decisions"][0]
        if d["status"] != 0:
            print("not routed: %s" % d["message"])
            return 1
        print("chosen worker %d (depth %d), prediction owner %s (depth %s), source %s, policy %s"
              % (d["chosen_worker"], d.get("chosen_depth", 0), d.get("owner_worker"),
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
            ack = client.workers("update", [{"pool": "default", "worker": worker, "healthy": healthy}])
            if ack["items"][0]["status"] != 0:
                print("health update refused: %s" % ack["items"][0].get("message"))
                return 1
            if not healthy:
                only = client.route([{"request_id": "example-down", "tokens": prompt,
                                      "candidates": [worker]}])["decisions"][0]
                print("worker %d marked unhealthy; a route that allows only it: %s"
                      % (worker, only.get("message")))
                if only["status"] != -21:  # KM_ERR_NO_HEALTHY_WORKER
                    return 1

        # Pipelined: many requests in flight on one connection, replies matched by id.
        ids = [client.send_route([{"request_id": "example-p%d" % i, "tokens": prompt[: 16 * (i + 1)]}])
               for i in range(4)]
        for rid in ids:
            print("request %d -> worker %d" % (rid, client.wait(rid)["decisions"][0]["chosen_worker"]))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "unix:/tmp/kvmatch.sock"))
    except (KvmatchError, OSError, TimeoutError) as e:
        print("kvmatch: %s" % e, file=sys.stderr)
        sys.exit(1)
