#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Every Criterion test bounds its own time: each Test(SUITE, NAME, ...) in tests/*.c names a
.timeout among its options.

usage: check_timeouts.py [ROOT]    (default: the working directory)

Prints each test without one as FILE:LINE: SUITE/NAME and exits 1; exits 0 when there is none.
"""
import os
import re
import sys

TEST = re.compile(r"^Test\s*\(", re.M)


def declaration(text, start):
    """The text of Test( ... ) from start, to its closing parenthesis."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return text[start:]


def check(root):
    bad = []
    folder = os.path.join(root, "tests")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".c"):
            continue
        path = os.path.join(folder, name)
        text = open(path, encoding="utf-8").read()
        for m in TEST.finditer(text):
            decl = declaration(text, m.end() - 1)
            if re.search(r"\.timeout\s*=", decl):
                continue
            args = [a.strip() for a in decl[1:-1].split(",")]
            line = text.count("\n", 0, m.start()) + 1
            label = "/".join(args[:2])
            bad.append(f"tests/{name}:{line}: {label} has no .timeout")
    return bad


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    bad = check(root)
    for b in bad:
        print(b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
