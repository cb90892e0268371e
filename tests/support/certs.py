"""Certificates made for a test with the openssl CLI: a CA, and a server and a client
certificate it signed, both valid for 127.0.0.1 and localhost (one day)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

__all__ = ["make_certs", "needs_openssl"]

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None,
                                   reason="openssl CLI needed to make test certificates")


def make_certs(d: Path) -> Path:
    """Write ca.pem/ca.key, server.pem/server.key and client.pem/client.key into ``d``."""
    d.mkdir(parents=True, exist_ok=True)

    def ossl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)
    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
         "-days", "1", "-subj", "/CN=ace-test-ca")
    for who in ("server", "client"):
        ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out", f"{who}.csr",
             "-subj", f"/CN={who}")
        ext = d / f"{who}.ext"
        ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        ossl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{who}.pem", "-days", "1", "-extfile", str(ext))
    return d
