#!/usr/bin/env bash
# uPlot (MIT), the dashboard's chart library: its built files, from the npm registry at a pinned
# version checked against the registry's integrity hash, into the dashboard's static files, where
# the dashboard serves them itself (no page loads anything from another host). Run it to move to
# another version (change VERSION and INTEGRITY: `npm view uplot@X dist.integrity`); the files it
# writes are committed, so neither set-up nor CI needs npm.
set -euo pipefail

VERSION=1.6.32
INTEGRITY=sha512-KIMVnG68zvu5XXUbC4LQEPnhwOxBuLyW1AHtpm6IKTXImkbLgkMy+jabjLgSLMasNuGGzQm/ep3tOkyTxpiQIw==
DEST="$(cd "$(dirname "$0")/.." && pwd)/coordinator/web/dashboard/static/vendor/uplot"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "uplot@$VERSION" >/dev/null)
tarball="$tmp/uplot-$VERSION.tgz"
got="sha512-$(openssl dgst -sha512 -binary "$tarball" | base64 -w0)"
if [ "$got" != "$INTEGRITY" ]; then
    echo "uplot $VERSION: the registry's tarball does not match the pinned integrity hash" >&2
    exit 1
fi
tar -xzf "$tarball" -C "$tmp"
mkdir -p "$DEST"
cp "$tmp/package/dist/uPlot.iife.min.js" "$tmp/package/dist/uPlot.min.css" \
    "$tmp/package/LICENSE" "$DEST/"
(cd "$DEST" && sha256sum uPlot.iife.min.js uPlot.min.css LICENSE >SHA256SUMS)
echo "uplot $VERSION -> $DEST"
