"""The ext_proc port's TLS certificate: given files, or a self-signed one made at start-up.

Gateways connect to an endpoint picker over TLS without verifying its certificate (the
inference extension's reference picker serves a self-signed one), so ``--protocol epp``
makes one with the ``openssl`` CLI (the ``cryptography`` package is not a dependency)
unless ``--tls-cert``/``--tls-key`` are given. The key never leaves a private temporary
directory, removed once read.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from extproc.errors import ConfigError

__all__ = ["ServingCert", "self_signed", "load_cert"]


@dataclass(frozen=True)
class ServingCert:
    cert_pem: bytes
    key_pem: bytes


def load_cert(cert: Path, key: Path) -> ServingCert:
    return ServingCert(Path(cert).read_bytes(), Path(key).read_bytes())


def self_signed(common_name: str = "ace-epp") -> ServingCert:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ConfigError("--secure-serving needs the openssl CLI for a self-signed certificate "
                          "(or give --tls-cert and --tls-key)")
    with tempfile.TemporaryDirectory(prefix="ace-epp-cert-") as tmp:
        cert, key = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
        try:
            subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                            "ec_paramgen_curve:prime256v1", "-nodes", "-days", "365",
                            "-subj", f"/CN={common_name}", "-addext",
                            "subjectAltName=DNS:localhost,IP:127.0.0.1",
                            "-keyout", str(key), "-out", str(cert)],
                           check=True, capture_output=True, timeout=30)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            raise ConfigError(f"openssl could not make a self-signed certificate: {exc}") from exc
        return load_cert(cert, key)
