#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Print the linker version script of libkvmatch.so: every function the public headers in DIR
# (include/kvmatch) declare is global, everything else local, so the shared library's interface is
# the documented API and nothing of the implementation (km_srv_*, helpers) leaks into it.
# A declaration is a "km_name(" that starts a line or follows a return type, outside comments.
set -euo pipefail
dir=${1:?usage: export-map.sh INCLUDE_DIR}
mapfile -t names < <(
    for h in "$dir"/*.h; do
        # drop /* ... */ comments (they name functions in prose) and preprocessor lines
        perl -0777 -pe 's{/\*.*?\*/}{}gs; s{^\s*#.*$}{}gm' "$h"
    done | grep -oE '(^|[ *])km_[a-z0-9_]+\(' | sed -E 's/^[ *]//; s/\($//' | sort -u)
[ ${#names[@]} -gt 0 ] || { echo "export-map.sh: no declarations found in $dir" >&2; exit 1; }
echo "KVMATCH_0 {"
echo "  global:"
printf '    %s;\n' "${names[@]}"
echo "  local:"
echo "    *;"
echo "};"
