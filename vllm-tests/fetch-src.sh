#!/usr/bin/env bash
# Fetches vLLM's source distribution (VLLM_VERSION, default 0.34.0) from PyPI (its tests are not in the wheel), checks
# its sha256 and extracts the parts the tests need into DEST (default .vllm-src): tests/ (they
# import one another as the `tests` package) and pyproject.toml (pytest's markers). vllm/ itself
# is not extracted: the tests must import the installed vLLM, not the source tree.
set -euo pipefail
DEST=${1:-.vllm-src}
VERSION=${VLLM_VERSION:-0.34.0}
case "$VERSION" in
0.33.0)
    URL=https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz
    SHA256=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112 ;;
0.34.0)
    URL=https://files.pythonhosted.org/packages/92/21/6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/vllm-0.34.0.tar.gz
    SHA256=fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113 ;;
*)
    echo "no source distribution recorded for vLLM $VERSION (add its URL and sha256 here)" >&2
    exit 2 ;;
esac
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
