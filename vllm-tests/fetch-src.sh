#!/usr/bin/env bash
# Fetches vLLM 0.33.0's source distribution from PyPI (its tests are not in the wheel), checks
# its sha256 and extracts the parts the tests need into DEST (default .vllm-src): tests/ (they
# import one another as the `tests` package) and pyproject.toml (pytest's markers). vllm/ itself
# is not extracted: the tests must import the installed vLLM, not the source tree.
set -euo pipefail
DEST=${1:-.vllm-src}
VERSION=0.33.0
URL=https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-$VERSION.tar.gz
SHA256=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
TARBALL="$DEST/vllm-$VERSION.tar.gz"

mkdir -p "$DEST"
if ! echo "$SHA256  $TARBALL" | sha256sum -c --status 2>/dev/null; then
    echo "downloading $URL"
    curl -fsSL --retry 3 -o "$TARBALL.part" "$URL"
    mv "$TARBALL.part" "$TARBALL"
fi
echo "$SHA256  $TARBALL" | sha256sum -c --quiet || {
    echo "sha256 mismatch for $TARBALL" >&2; rm -f "$TARBALL"; exit 1; }
rm -rf "$DEST/tests" "$DEST/pyproject.toml"
tar -xzf "$TARBALL" -C "$DEST" --strip-components=1 \
    "vllm-$VERSION/tests" "vllm-$VERSION/pyproject.toml"
echo "vLLM $VERSION tests extracted into $DEST"
