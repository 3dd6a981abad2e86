#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Check that the compiler kept the software prefetches of the hot paths.

GCC 12 finds a function whose only effects are __builtin_prefetch calls "const" and deletes the
calls to it that it has not inlined yet, so a prefetch helper can lose every instruction without
a warning (src/index/slot_walk.h, KM_PREFETCHER). This script finds every prefetch call under src/,
disassembles the objects built from src/ with line information (objdump -dl) and checks that each
such line produced at least one prefetch instruction somewhere in them.

usage: check_prefetch.py BUILD_DIR
exit 0: all found; 1: some line has none (listed); 2: cannot check (no objdump, no objects).
"""
import re
import shutil
import subprocess
import sys
from pathlib import Path

# Every line under src/ that calls a prefetch (KM_PREFETCH or __builtin_prefetch; not the macro's
# own #define) must produce a prefetch instruction in some object built from src/.
CALL = re.compile(r"\b(KM_PREFETCH|__builtin_prefetch)\s*\(")


def marked_lines(root):
    """(path relative to root, line number, text) of each prefetch call under root/src."""
    marked = []
    for path in sorted((root / "src").rglob("*")):
        if path.suffix not in (".c", ".h"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if CALL.search(line) and not line.lstrip().startswith("#"):
                marked.append((path.relative_to(root).as_posix(), n, line.strip()))
    return marked


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build = Path(sys.argv[1])
    if not shutil.which("objdump"):
        print("check_prefetch: objdump not found")
        return 2
    root = Path(__file__).resolve().parent.parent
    marked = marked_lines(root)
    objects = sorted((build / "src").rglob("*.o"))
    if not marked or not objects:
        print(f"check_prefetch: nothing to check ({len(marked)} prefetch lines, "
              f"{len(objects)} objects under {build / 'src'})")
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
                where = (m.group(1), int(m.group(2)))
            elif "prefetch" in line and where:
                found.add(where)
    absent = []
    for path, n, text in marked:
        # objdump names a file as the compiler was given it: relative or absolute.
        if not any(line == n and (f == path or f.endswith("/" + path)) for f, line in found):
            absent.append(f"{path}:{n}: {text}")
    if absent:
        print("check_prefetch: no prefetch instruction was emitted for:")
        print("\n".join("  " + a for a in absent))
        return 1
    print(f"check_prefetch: all {len(marked)} prefetch lines under src/ have instructions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
