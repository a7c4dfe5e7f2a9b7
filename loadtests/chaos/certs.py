"""A throwaway self-signed certificate for the lab's control plane (openssl), valid for given IPs."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path


def make_cert(out: Path, addrs: Sequence[str]) -> tuple[Path, Path]:
    """cert.pem and key.pem in `out`, for the gateways' addresses `addrs` (subjectAltName IPs)."""
    cert, key = out / "control-cert.pem", out / "control-key.pem"
    san = ",".join(f"IP:{a}" for a in addrs)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=lumen-chaos",
         "-addext", f"subjectAltName={san}"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    key.chmod(0o600)
    return cert, key
