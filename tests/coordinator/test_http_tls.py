"""The HTTP API over TLS with uvicorn's own options, as `specfleet up --ssl-certfile` serves it."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl
import urllib.request
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from sqlalchemy.engine import Engine

from broker.mosquitto import free_port
from coordinator.stack import http_api
from coordinator.web.api.main import create_app
from core.settings import Settings


def self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


def test_the_api_serves_https_with_a_certificate(sqlite_engine: Engine, tmp_path: Path) -> None:
    cert_file, key_file = self_signed(tmp_path)
    app = create_app(Settings(secret_key="a-test-secret-of-32-characters!!"), sqlite_engine)
    port = free_port()
    trusted = ssl.create_default_context(cafile=str(cert_file))

    def get(url: str, context: ssl.SSLContext | None = None) -> bytes:
        with urllib.request.urlopen(url, timeout=10, context=context) as response:
            body: bytes = response.read()
            return body

    async def scenario() -> None:
        async with http_api(app, "127.0.0.1", port, ssl_certfile=cert_file, ssl_keyfile=key_file):
            url = f"https://127.0.0.1:{port}/api/v1/openapi.json"
            body = await asyncio.to_thread(get, url, trusted)
            assert json.loads(body)["info"]["title"] == "specfleet coordinator"
            # Plain HTTP gets no API on a TLS port.
            with pytest.raises(OSError):
                await asyncio.to_thread(get, f"http://127.0.0.1:{port}/api/v1/openapi.json")

    asyncio.run(scenario())


def test_tls_needs_both_files(sqlite_engine: Engine, tmp_path: Path) -> None:
    cert_file, _ = self_signed(tmp_path)
    app = create_app(Settings(secret_key="a-test-secret-of-32-characters!!"), sqlite_engine)

    async def scenario() -> None:
        async with http_api(app, "127.0.0.1", free_port(), ssl_certfile=cert_file):
            pass

    with pytest.raises(ValueError, match="both"):
        asyncio.run(scenario())
