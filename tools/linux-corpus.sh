#!/usr/bin/env bash
# tools/linux-corpus.sh — about 1.3 GB of C and its documentation that Debian ships: every file of
# the Linux kernel's source (linux-source-6.1) in sorted path order, packed in zstd frames that a run
# reads in place (`dormouse corpus pack`): a corpus of gigabytes to try streaming at scale, and one
# that 200 steps of b1 never repeat. docs/training.md, "Corpora".
#
#   tools/linux-corpus.sh [OUT]         default OUT: corpora/linux.zst
#
# Needs apt-get (the package is downloaded, not installed), dpkg, tar, xz, about 2 GB of free disk
# for the unpacked tree (removed at the end), and dormouse (build/dormouse, or $DORMOUSE).
set -euo pipefail
out=${1:-corpora/linux.zst}
dormouse=${DORMOUSE:-build/dormouse}
for tool in apt-get dpkg tar xz "$dormouse"; do
  command -v "$tool" >/dev/null || { echo "linux-corpus: $tool is missing (build dormouse first: make)" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$(dirname "$out")"
(cd "$work" && apt-get download -q linux-source-6.1 >/dev/null 2>&1) ||
  { echo "linux-corpus: apt-get download linux-source-6.1 failed (no network or no package lists?)" >&2; exit 1; }
dpkg -x "$work"/linux-source-6.1_*.deb "$work/deb"
tar xJf "$work"/deb/usr/src/linux-source-6.1.tar.xz -C "$work"
(cd "$work" && find linux-source-6.1 -type f | LC_ALL=C sort | sed "s|^|$work/|") > "$work/files"
echo "linux-corpus: $(wc -l < "$work/files") files"
"$dormouse" corpus pack "$out" --files-from "$work/files" --level 3 --force
