#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Validate kvmatch records files (JSONL) against docs/records.schema.json.

usage: check_records.py [--schema FILE] [--require-links] FILE...

Every line of every FILE must be one JSON object (RFC 8259: no NaN or Infinity, no key twice in
one object, integers within 64 bits) that validates against the schema (JSON Schema draft
2020-12, python3-jsonschema). Beyond the schema it checks what a schema cannot say:
depth_tokens = depth_blocks * block_size, decision.owner_is_chosen agrees with the worker names,
an owner with no worker has no state and depth 0, and an outcome's copied prediction equals its
decision's when both are in the files given. With --require-links an outcome whose decision is not
in the files is a failure too (without it, a note: the decision may be in a rotated file).

Exit status: 0 when every line is valid, 1 when any failed (each failure is listed as
FILE:LINE: where: message), 2 on a usage error or when jsonschema is missing.
"""
import argparse
import json
import os
import sys


def load_validator(schema_path):
    try:
        import jsonschema
    except ImportError:
        print("check_records: python3-jsonschema is not installed", file=sys.stderr)
        sys.exit(2)
    with open(schema_path, encoding="utf-8") as f:
        schema = json.load(f)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1


def no_constant(name):
    """NaN, Infinity and -Infinity are not JSON (RFC 8259), though json.loads reads them."""
    raise ValueError(f"{name} is not a JSON value")


def no_duplicate_keys(pairs):
    """An object with a key twice: readers disagree on which value counts."""
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"key {key!r} appears twice in one object")
        obj[key] = value
    return obj


def bounded_int(text):
    """Integers are below 2^63 (docs/RECORDS.md), what a C reader's int64 holds."""
    value = int(text)
    if not INT_MIN <= value <= INT_MAX:
        raise ValueError(f"integer {text} is outside the 64-bit signed range")
    return value


def parse_record(text):
    return json.loads(text, parse_constant=no_constant, object_pairs_hook=no_duplicate_keys,
                      parse_int=bounded_int)


def semantic_errors(rec):
    """Cross-field rules of docs/RECORDS.md that the schema does not express."""
    errors = []
    if rec.get("type") == "decision":
        pred, dec = rec["prediction"], rec["decision"]
        bs = pred["block_size"]
        owner, chosen = pred["owner"], dec["chosen"]
        for where, w in (("prediction.owner", owner), ("decision.chosen", chosen)):
            if w["depth_tokens"] != w["depth_blocks"] * bs:
                errors.append(f"{where}: depth_tokens != depth_blocks * block_size")
        for i, c in enumerate(rec["candidates"]):
            if c["depth_tokens"] != c["depth_blocks"] * bs:
                errors.append(f"candidates[{i}]: depth_tokens != depth_blocks * block_size")
        if owner["worker"] is None and (owner["state"] is not None or owner["depth_blocks"] != 0):
            errors.append("prediction.owner: no worker, but a state or a depth")
        same = owner["worker"] is not None and owner["worker"] == chosen["worker"]
        if dec["owner_is_chosen"] != same:
            errors.append("decision.owner_is_chosen disagrees with the worker names")
    elif rec.get("type") == "outcome":
        p = rec["predicted"]
        bs = p["block_size"]
        if p["depth_tokens"] != p["depth_blocks"] * bs:
            errors.append("predicted: depth_tokens != depth_blocks * block_size")
        if p["owner_depth_tokens"] != p["owner_depth_blocks"] * bs:
            errors.append("predicted: owner_depth_tokens != owner_depth_blocks * block_size")
        for name, start, end in (("wait_ns", "decided", "dispatched"),
                                 ("ttft_ns", "decided", "first_token")):
            a, b = rec[start + "_monotonic_ns"], rec[end + "_monotonic_ns"]
            expect = b - a if a is not None and b is not None else None
            if rec[name] != expect:
                errors.append(f"{name} is not {end}_monotonic_ns - {start}_monotonic_ns")
    return errors


def link_errors(decision, outcome):
    """The outcome's copy of the prediction must equal its decision's."""
    pred, dec = decision["prediction"], decision["decision"]
    p = outcome["predicted"]
    expect = {
        "worker": dec["chosen"]["worker"],
        "predicted.source": pred["source"],
        "predicted.block_size": pred["block_size"],
        "predicted.depth_blocks": dec["chosen"]["depth_blocks"],
        "predicted.owner_worker": pred["owner"]["worker"],
        "predicted.owner_depth_blocks": pred["owner"]["depth_blocks"],
        "request_id": decision["request_id"],
        "attempt_id": decision["attempt_id"],
    }
    got = {
        "worker": outcome["worker"],
        "predicted.source": p["source"],
        "predicted.block_size": p["block_size"],
        "predicted.depth_blocks": p["depth_blocks"],
        "predicted.owner_worker": p["owner_worker"],
        "predicted.owner_depth_blocks": p["owner_depth_blocks"],
        "request_id": outcome["request_id"],
        "attempt_id": outcome["attempt_id"],
    }
    return [f"{k} is {got[k]!r}, its decision says {expect[k]!r}"
            for k in expect if got[k] != expect[k]]


def main(argv):
    default_schema = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs",
                                  "records.schema.json")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schema", default=default_schema)
    ap.add_argument("--require-links", action="store_true")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    validator = load_validator(args.schema)

    failures = []
    decisions = {}  # (instance, decision_id) -> record
    outcomes = []   # (file, line, record)
    lines = 0
    for path in args.files:
        try:
            f = open(path, "rb")
        except OSError as e:
            failures.append(f"{path}: cannot open: {e.strerror}")
            continue
        with f:
            for number, raw in enumerate(f, 1):
                lines += 1
                where = f"{path}:{number}"
                if not raw.endswith(b"\n"):
                    failures.append(f"{where}: the last line has no newline (cut short?)")
                try:
                    rec = parse_record(raw.decode("utf-8"))
                except (UnicodeDecodeError, ValueError) as e:
                    failures.append(f"{where}: not a JSON document: {e}")
                    continue
                errs = sorted(validator.iter_errors(rec), key=lambda e: list(e.absolute_path))
                for e in errs:
                    loc = "/".join(str(p) for p in e.absolute_path) or "(record)"
                    failures.append(f"{where}: {loc}: {e.message}")
                if errs:
                    continue
                for msg in semantic_errors(rec):
                    failures.append(f"{where}: {msg}")
                key = (rec["instance"], rec["decision_id"])
                if rec["type"] == "decision":
                    if key in decisions:
                        failures.append(f"{where}: decision_id {rec['decision_id']} appears twice")
                    decisions[key] = rec
                else:
                    outcomes.append((where, rec))

    notes = 0
    for where, rec in outcomes:
        key = (rec["instance"], rec["decision_id"])
        if key not in decisions:
            msg = f"{where}: outcome of decision {rec['decision_id']}, which is not in these files"
            if args.require_links:
                failures.append(msg)
            else:
                notes += 1
            continue
        for msg in link_errors(decisions[key], rec):
            failures.append(f"{where}: {msg}")

    for msg in failures:
        print(msg)
    print(f"check_records: {lines} line(s), {len(decisions)} decision(s), {len(outcomes)} "
          f"outcome(s), {notes} outcome(s) without their decision, {len(failures)} failure(s)",
          file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
