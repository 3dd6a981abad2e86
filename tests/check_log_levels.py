#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Every log line kvmatch writes of its own states its level (include/kvmatch/log.h): each call of
the library's log helpers passes a format that starts with KM_LOG_ERROR, KM_LOG_WARNING or
KM_LOG_INFO.

usage: check_log_levels.py [ROOT]    (default: the working directory)

Prints each call that states no level as FILE:LINE and exits 1; exits 0 when there is none.
"""
import os
import re
import sys

HELPERS = ["km_srv_log", "feed_log", "sub_log", "cluster_log", "km_index_log"]
CALL = re.compile(r"\b(" + "|".join(HELPERS) + r")\s*\(")


def check(root):
    bad = []
    for folder, _, files in os.walk(os.path.join(root, "src")):
        for name in sorted(files):
            if not name.endswith(".c"):
                continue
            path = os.path.join(folder, name)
            text = open(path, encoding="utf-8").read()
            for m in CALL.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                head = text[text.rfind("\n", 0, m.start()) + 1:m.start()]
                if re.match(r"\s*(static\s+)?(void|int)\b", head) or head.strip().startswith(("*", "//")):
                    continue  # a definition or a comment
                args = text[m.end():m.end() + 400]
                # the format is the first argument that is a string literal or starts with KM_LOG_
                fmt = re.search(r'(KM_LOG_(?:ERROR|WARNING|INFO)\b|")', args)
                if not fmt or fmt.group(1) == '"':
                    bad.append(f"{os.path.relpath(path, root)}:{line}: {m.group(1)} states no level")
    return bad


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    bad = check(root)
    for b in bad:
        print(b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
