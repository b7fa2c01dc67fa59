#!/usr/bin/env bash
# tools/english-corpus.sh — about 68 MB of English text that Debian ships, as one zstd file: the
# GNU Collaborative International Dictionary of English (dict-gcide, 40 MB) and the Linux
# kernel's documentation (the .rst and .txt files of linux-source-6.1's Documentation/, 28.5 MB,
# in sorted path order). A corpus that b1's learning-quality runs do not repeat (2,000 steps of
# 8 x 1024 bytes read 16 MB); docs/training.md, "Balance at b1".
#
#   tools/english-corpus.sh [OUT]       default OUT: corpora/english.txt.zst
#
# Needs apt-get (the packages are downloaded, not installed), dpkg, tar, xz, and dormouse
# (build/dormouse, or $DORMOUSE), which writes the text in zstd frames that a run reads in place.
set -euo pipefail
out=${1:-corpora/english.txt.zst}
dormouse=${DORMOUSE:-build/dormouse}
for tool in apt-get dpkg tar xz "$dormouse"; do
  command -v "$tool" >/dev/null || { echo "english-corpus: $tool is missing (build dormouse first: make)" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$(dirname "$out")"
(cd "$work" && apt-get download -q dict-gcide linux-source-6.1 >/dev/null 2>&1) ||
  { echo "english-corpus: apt-get download dict-gcide linux-source-6.1 failed (no network or no package lists?)" >&2; exit 1; }
dpkg -x "$work"/dict-gcide_*.deb "$work/gcide"
dpkg -x "$work"/linux-source-6.1_*.deb "$work/linux"
tar xJf "$work"/linux/usr/src/linux-source-6.1.tar.xz -C "$work" linux-source-6.1/Documentation
{
  (cd "$work/linux-source-6.1" && find Documentation -type f \( -name '*.rst' -o -name '*.txt' \) -print0 |
     LC_ALL=C sort -z | xargs -0 cat)
  zcat "$work"/gcide/usr/share/dictd/gcide.dict.dz
} > "$work/english.txt"
"$dormouse" corpus pack "$out" "$work/english.txt" --force
