#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Check a `kvmatch analyze --html` report (python3 stdlib only).

usage: check_html.py REPORT.html [--expect-svg N] [--dom DUMPED_DOM.html]

- self-contained: no <script>, <link>, <iframe>, <img>, @import or url(...), and no src= / href=
  attribute pointing anywhere (the SVG namespace in xmlns= is a name, not a fetch);
- every <svg>...</svg> element parses as XML (xml.etree.ElementTree), is in the SVG namespace and
  draws something (circle, polyline, rect or text);
- --expect-svg N: exactly N <svg> elements;
- --dom FILE: a DOM dumped by a browser (chromium --dump-dom) holds the same number of <svg>
  elements, each with its id, i.e. the browser parsed and kept the charts.
Exit 0 when all holds, 1 listing each failure, 2 on a usage error.
"""
import re
import sys
import xml.etree.ElementTree as ET

SVG_NS = "{http://www.w3.org/2000/svg}"


def fail(failures, message):
    failures.append(message)


def check(path, expect_svg, dom_path):
    failures = []
    with open(path, encoding="utf-8") as f:
        html = f.read()
    lowered = html.lower()
    for forbidden in ("<script", "<link", "<iframe", "<img", "@import", "url("):
        if forbidden in lowered:
            fail(failures, f"{path}: contains {forbidden!r}: not self-contained")
    for attribute in re.finditer(r'\s(src|href|xlink:href)\s*=\s*"([^"]*)"', html, re.I):
        fail(failures, f"{path}: {attribute.group(1)}={attribute.group(2)!r} refers elsewhere")
    svgs = re.findall(r"<svg\b.*?</svg>", html, re.S)
    if expect_svg is not None and len(svgs) != expect_svg:
        fail(failures, f"{path}: {len(svgs)} <svg> elements, expected {expect_svg}")
    ids = []
    for i, text in enumerate(svgs):
        try:
            root = ET.fromstring(text)
        except ET.ParseError as e:
            fail(failures, f"{path}: svg #{i} is not well-formed XML: {e}")
            continue
        if root.tag != SVG_NS + "svg":
            fail(failures, f"{path}: svg #{i} root is {root.tag}, not in the SVG namespace")
        drawn = [el for el in root.iter()
                 if el.tag in (SVG_NS + "circle", SVG_NS + "polyline", SVG_NS + "rect", SVG_NS + "text")]
        if not drawn:
            fail(failures, f"{path}: svg #{i} draws nothing")
        ids.append(root.get("id"))
    if dom_path:
        with open(dom_path, encoding="utf-8", errors="replace") as f:
            dom = f.read()
        dom_svgs = re.findall(r"<svg\b[^>]*>", dom)
        if len(dom_svgs) != len(svgs):
            fail(failures, f"{dom_path}: the browser's DOM has {len(dom_svgs)} <svg> elements, "
                           f"the report {len(svgs)}")
        for svg_id in ids:
            if svg_id and f'id="{svg_id}"' not in dom:
                fail(failures, f"{dom_path}: svg {svg_id!r} missing from the browser's DOM")
    return failures, len(svgs)


def main(argv):
    args = argv[1:]
    if not args or args[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    path, expect_svg, dom_path = args[0], None, None
    rest = args[1:]
    while rest:
        if rest[0] == "--expect-svg" and len(rest) > 1 and rest[1].isdigit():
            expect_svg = int(rest[1])
        elif rest[0] == "--dom" and len(rest) > 1:
            dom_path = rest[1]
        else:
            print(f"check_html.py: bad argument {rest[0]!r}", file=sys.stderr)
            return 2
        rest = rest[2:]
    try:
        failures, n = check(path, expect_svg, dom_path)
    except OSError as e:
        print(f"check_html.py: {e}", file=sys.stderr)
        return 1
    for line in failures:
        print(line)
    if not failures:
        print(f"{path}: ok, {n} svg element(s) well-formed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
