#!/usr/bin/env python3
"""Check that the compiler kept the software prefetches of the hot paths.

GCC 12 finds a function whose only effects are __builtin_prefetch calls "const" and deletes the
calls to it that it has not inlined yet, so a prefetch helper can lose every instruction without
a warning (src/shared.h, KM_PREFETCHER). This script disassembles the given objects with line
information (objdump -dl) and checks that each marked source line below produced at least one
prefetch instruction somewhere in them.

usage: check_prefetch.py BUILD_DIR
exit 0: all found; 1: some line has none (listed); 2: cannot check (no objdump, no objects).
"""
import re
import shutil
import subprocess
import sys
from pathlib import Path

# (source file, a text that appears on exactly the line holding the prefetch)
MARKED = [
    ("src/shared.h", "KM_PREFETCH(&v->slots[km_slot_home(key, v->shift)]);"),
    ("src/shared.h", "KM_PREFETCH(&hashes[k * S]);"),
    ("src/shared.h", "KM_PREFETCH(&hashes[(k + 1) * S - 1]);"),
    ("src/u64map.h", "__builtin_prefetch(&now[h & (m->capacity - 1)]);"),
    ("src/u64map.h", "__builtin_prefetch(&before[h & (m->old_capacity - 1)]);"),
    ("src/emap.h", "__builtin_prefetch(m->entries + km_oamap_home(key, m->capacity)"),
    ("src/emap.h", "__builtin_prefetch(m->old + km_oamap_home(key, m->old_capacity)"),
]
OBJECTS = ["src/backend_cpu.o", "src/approx.o", "src/index.o", "src/feed.o"]


def line_of(path, text):
    lines = Path(path).read_text().splitlines()
    hits = [i + 1 for i, line in enumerate(lines) if text in line]
    if len(hits) != 1:
        sys.exit(f"check_prefetch: '{text}' is on {len(hits)} lines of {path}, expected 1")
    return hits[0]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build = Path(sys.argv[1])
    if not shutil.which("objdump"):
        print("check_prefetch: objdump not found")
        return 2
    objects = [build / o for o in OBJECTS]
    missing = [str(o) for o in objects if not o.exists()]
    if missing:
        print("check_prefetch: objects not built: " + ", ".join(missing))
        return 2
    found = set()  # (file name, line) of each prefetch instruction
    where = None
    loc = re.compile(r"^(/?\S+):(\d+)( \(discriminator \d+\))?$")
    for obj in objects:
        out = subprocess.run(["objdump", "-dl", str(obj)], capture_output=True, text=True,
                             check=True).stdout
        for line in out.splitlines():
            m = loc.match(line.strip())
            if m:
                where = (Path(m.group(1)).name, int(m.group(2)))
            elif "prefetch" in line and where:
                found.add(where)
    absent = []
    for path, text in MARKED:
        n = line_of(path, text)
        if (Path(path).name, n) not in found:
            absent.append(f"{path}:{n}: {text}")
    if absent:
        print("check_prefetch: no prefetch instruction was emitted for:")
        print("\n".join("  " + a for a in absent))
        return 1
    print(f"check_prefetch: all {len(MARKED)} marked prefetch lines have instructions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
