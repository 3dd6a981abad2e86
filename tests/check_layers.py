#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Check kvmatch's dependency rules: which part of the tree may include which.

usage: check_layers.py [ROOT]          check the tree at ROOT (default: this repository)
       check_layers.py --exceptions    print the tolerated violations, one "path<TAB>include" a line
Prints each violation as "path:line: rule: detail", then a count; exits 0 when there is none, 1
when there is any, 2 when ROOT has no src/. tests/ and bench/ are outside the rules.

The rules (docs/ARCHITECTURE.md, "Dependency rules", says the same in prose):
  layer            the folders of src/ are layers: base 0 < index 1 < events 2 = decide 2 <
                   cluster 3 < service 4 < sim 5 = analyze 5 < cli 6, and each public header in
                   include/kvmatch/ belongs to one (PUBLIC below; the umbrella kvmatch.h to cli).
                   A file, or a public header, includes only headers of its own layer or lower.
  decide           src/decide/ and the decide public headers include only base (src/base/,
                   error.h, log.h, text.h), the index's public index.h, and decide itself.
  kernels-boundary src/ and include/ never include anything from kernels/.
  kernels-scope    kernels/ (the CUDA backend) includes only src/index/, src/base/, the public
                   headers of base and index, and its own files.
  internal         a header named *_internal.h is included only from its own folder; kernels/
                   may include index/index_internal.h (it implements an index backend).
  public-src       include/kvmatch/ includes only include/kvmatch/ (never src/).
  cuda             CUDA (cuda_runtime.h, cuda* runtime names, <<<, __global__, __device__,
                   __host__, __shared__) appears only in kernels/; the one exception is the
                   KM_HD macro's definition in src/index/slot_walk.h (host+device per-element code).
  qualified        every project include in src/ and kernels/ names its path from src/ or
                   include/ ("index/host_table.h", "kvmatch/index.h"); kernels/ may name its own
                   files bare ("cuda_seam.h").
  unplaced         every folder of src/ and every public header has a layer in the tables below.
  stale-exception  each entry of EXCEPTIONS still matches an include in the tree.
Comments are ignored; an include inside #if counts like any other.
"""
import re
import sys
from pathlib import Path

LAYERS = {"base": 0, "index": 1, "events": 2, "decide": 2, "cluster": 3, "service": 4, "sim": 5,
          "analyze": 5, "cli": 6}

# The layer of each public header (include/kvmatch/<name>).
PUBLIC = {
    "error.h": "base", "log.h": "base", "text.h": "base", "version.h": "base",
    "hash.h": "index", "index.h": "index",
    "kv_events.h": "events", "feed.h": "events", "subscriber.h": "events", "publisher.h": "events",
    "policy.h": "decide", "active.h": "decide", "approx.h": "decide", "engine_model.h": "decide",
    "cluster.h": "cluster", "engine_metrics.h": "cluster",
    "protocol.h": "service", "client.h": "service", "records.h": "service",
    "metrics.h": "service", "server.h": "service",
    "kvmatch.h": "cli",
}

# The one public header above base that decide may include besides its own.
DECIDE_INDEX = "index.h"

# Tolerated violations, each removed together with its fix: (file, include) -> why it is waived.
EXCEPTIONS = {}

SOURCE_SUFFIXES = {".c", ".h", ".cu", ".cuh"}
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"]+)[>"]', re.M)
CUDA = re.compile(r"cuda_runtime|\bcuda[A-Z]\w*|<<<|\b__(global|device|host|shared)__\b")
CUDA_EXCEPTION = ("src/index/slot_walk.h", re.compile(r"^[ \t]*#[ \t]*define[ \t]+KM_HD[ \t]"))


def strip(text, strings):
    """text with comments (and, when `strings`, the contents of string and character literals)
    blanked out, newlines kept, so offsets and line numbers stay those of the file."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            if not strings:
                i = j
                continue
            i += 1
            j -= 1
        else:
            i += 1
            continue
        for k in range(i, j):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


class Checker:
    def __init__(self, root):
        self.root = root
        self.violations = []
        self.used_exceptions = set()

    def report(self, path, line, rule, detail, include=None):
        if include is not None and (path, include) in EXCEPTIONS:
            self.used_exceptions.add((path, include))
            return
        self.violations.append((path, line, rule, detail))

    def owner(self, path):
        """The layer name a file of the tree belongs to, 'kernels', or None when it has none."""
        parts = path.split("/")
        if parts[0] == "kernels":
            return "kernels"
        if parts[0] == "src":
            return parts[1] if len(parts) > 2 and parts[1] in LAYERS else None
        return PUBLIC.get(parts[-1])

    def target(self, includer, include, quoted):
        """What an include names: ('public', header), ('src', folder), ('kernels', path), ('own',
        path) for a kernels/ file named bare, ('bare', include) for an unqualified project include,
        or None for a system or library header."""
        first, _, rest = include.partition("/")
        if first == "kvmatch" and rest:
            return ("public", rest)
        if first in LAYERS and rest:
            return ("src", first)
        if first == "kernels" and rest:
            return ("kernels", include)
        if not quoted:
            return None
        here = Path(includer).parent
        if includer.startswith("kernels/") and (self.root / here / include).is_file():
            return ("own", include)
        if (self.root / here / include).is_file() or "/" not in include:
            return ("bare", include)
        return None

    def check_include(self, path, line, include, quoted):
        tgt = self.target(path, include, quoted)
        if tgt is None:
            return
        kind, name = tgt
        where = path.split("/")[0]
        mine = self.owner(path)

        def say(rule, detail):
            self.report(path, line, rule, detail, include)

        if kind == "bare":
            if where != "include":
                say("qualified", f'"{include}" is not named by its path from src/ or include/')
            else:
                say("public-src", f'"{include}": a public header includes only kvmatch/ headers')
            return
        if kind == "kernels":
            if where == "kernels":
                return
            say("kernels-boundary", f"{include}: only kernels/ includes kernels/")
            return
        if where == "include" and kind == "src":
            say("public-src", f"{include}: a public header never includes src/")
            return
        if kind == "src" and name != mine and include.split("/")[-1].endswith("_internal.h"):
            if not (where == "kernels" and include == "index/index_internal.h"):
                say("internal", f"{include} is internal to src/{name}/")
                return
        if where == "kernels":
            ok = kind == "own" or (kind == "src" and name in ("index", "base")) or (
                kind == "public" and PUBLIC.get(name) in ("base", "index"))
            if not ok:
                say("kernels-scope", f"{include}: kernels/ includes only index, base and its own "
                    "files")
            return
        if mine is None:
            return  # reported once, as unplaced
        if kind == "public":
            theirs = PUBLIC.get(name)
            if theirs is None:
                return  # an unplaced header, reported at the header
        else:
            theirs = name
        if mine == "decide":
            ok = theirs in ("base", "decide") or (kind == "public" and name == DECIDE_INDEX)
            if not ok:
                say("decide", f"{include}: decide includes only base, index.h and its own headers")
            return
        if LAYERS[theirs] > LAYERS[mine]:
            say("layer", f"{mine} ({LAYERS[mine]}) includes {include} of {theirs} "
                f"({LAYERS[theirs]})")

    def check_file(self, path):
        text = (self.root / path).read_text(errors="replace")
        code = strip(text, strings=False)
        where = path.split("/")[0]
        if self.owner(path) is None and where != "kernels":
            what = "folder of src/" if where == "src" else "public header"
            self.report(path, 1, "unplaced", f"this {what} has no layer (tests/check_layers.py)")
        for m in INCLUDE.finditer(code):
            self.check_include(path, line_of(code, m.start()), m.group(2), m.group(1) == '"')
        if where == "kernels":
            return
        bare = strip(text, strings=True)
        lines = bare.split("\n")
        for m in CUDA.finditer(bare):
            n = line_of(bare, m.start())
            if path == CUDA_EXCEPTION[0] and CUDA_EXCEPTION[1].match(lines[n - 1]):
                continue
            self.report(path, n, "cuda", f"{m.group(0)} outside kernels/")

    def run(self):
        files = []
        for top in ("src", "kernels", "include/kvmatch"):
            base = self.root / top
            if base.is_dir():
                files += [p for p in base.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()]
        for p in sorted(files):
            self.check_file(p.relative_to(self.root).as_posix())
        for path, include in sorted(set(EXCEPTIONS) - self.used_exceptions):
            self.violations.append((path, 0, "stale-exception",
                                    f"{include} is no longer included here: remove its entry "
                                    "from EXCEPTIONS in tests/check_layers.py"))
        return self.violations


def main(argv):
    if argv[1:] == ["--exceptions"]:
        for path, include in sorted(EXCEPTIONS):
            print(f"{path}\t{include}")
        return 0
    if len(argv) > 2 or (len(argv) == 2 and argv[1].startswith("-")):
        sys.exit(__doc__)
    root = Path(argv[1]) if len(argv) == 2 else Path(__file__).resolve().parent.parent
    if not (root / "src").is_dir():
        print(f"check_layers: {root} has no src/")
        return 2
    violations = Checker(root).run()
    for path, line, rule, detail in violations:
        print(f"{path}:{line}: {rule}: {detail}")
    print(f"check_layers: {len(violations)} violation(s)")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
