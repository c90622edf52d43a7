"""The mesh's private CA and one certificate per service role (`llmmesh certs`, `make up`).

A certificate names its role twice: as a SPIFFE URI SAN (`spiffe://llmmesh/<role>/<id>`), which
servers read to authorize the caller, and as a DNS SAN `<role>.llmmesh`, which clients check as
the server's name (their channels override the target name to it), so a router dials only a
worker and a service exports spans only to a costd, whatever address it was given.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmmesh.identity import Role, role_dns_name, spiffe_id

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
# Long enough for a demo that runs for months; rotate with `llmmesh certs --rotate`.
LEAF_DAYS = 90
CA_DAYS = 3650


def cert_path(directory: str | Path, role: Role) -> Path:
    return Path(directory) / f"{role.value}.pem"


def key_path(directory: str | Path, role: Role) -> Path:
    return Path(directory) / f"{role.value}.key"


def _write_private(path: Path, data: bytes) -> None:
    """0600 from the first byte (no window where another user can read a key)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)   # readers (a reloading server) see the old file or the new, never half


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _builder(subject: str, issuer: x509.Name, public_key, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def create_ca(directory: str | Path, name: str = "llmmesh private CA") -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (_builder(name, subject, key.public_key(), CA_DAYS)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write_private(directory / CA_KEY, _key_pem(key))
    _write_private(directory / CA_CERT, cert.public_bytes(serialization.Encoding.PEM))


def issue(directory: str | Path, role: Role, instance: str = "local",
          extra_dns: Iterable[str] = (), days: int = LEAF_DAYS) -> Path:
    """A key and certificate for `role`, signed by the CA in `directory`; returns the cert path."""
    directory = Path(directory)
    ca_key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate((directory / CA_CERT).read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(spiffe_id(role, instance)),
        x509.DNSName(role_dns_name(role)), x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        *(x509.DNSName(d) for d in extra_dns)]
    cert = (_builder(f"{role.value}/{instance}", ca_cert.subject, key.public_key(), days)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    # Key first: a server reloading on the cert's change must never pair a new cert with an old key.
    _write_private(key_path(directory, role), _key_pem(key))
    _write_private(cert_path(directory, role), cert.public_bytes(serialization.Encoding.PEM))
    return cert_path(directory, role)


def ensure(directory: str | Path, roles: Iterable[Role] = tuple(Role), rotate: bool = False,
           extra_dns: Iterable[str] = ()) -> list[Role]:
    """Create the CA and each role's certificate where missing (all of them when `rotate`);
    returns the roles issued now. The CA itself is kept: rotating leaves every peer trusting."""
    directory = Path(directory)
    if not (directory / CA_CERT).exists():
        create_ca(directory)
    issued = []
    for role in roles:
        if rotate or not cert_path(directory, role).exists():
            issue(directory, role, extra_dns=extra_dns)
            issued.append(role)
    return issued
