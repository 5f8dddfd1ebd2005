"""Certificates and kubeconfigs for the e2e control plane (Python `cryptography`, no openssl CLI)."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _issue(ca_key, ca_cert, subject: x509.Name, *, server_names: list[str] | None = None,
           client: bool = False, days: int = 7) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    usage = [x509.ExtendedKeyUsageOID.CLIENT_AUTH] if client else [x509.ExtendedKeyUsageOID.SERVER_AUTH]
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.ExtendedKeyUsage(usage), critical=False))
    if server_names:
        sans: list[x509.GeneralName] = []
        for n in server_names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def make_ca(cn: str, days: int = 7) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA (key, certificate)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    ca_cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    return ca_key, ca_cert


def issue_serving_cert(pki: Path, out: Path, cn: str) -> None:
    """A serving cert for 127.0.0.1 issued by the cluster's CA, as tls.crt/tls.key in `out` (the file names
    controller-runtime's webhook server reads from its certDir): the CA is then the webhooks' caBundle."""
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    crt, key = _issue(ca_key, ca_cert, _name(cn), server_names=["127.0.0.1"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "tls.crt").write_bytes(crt)
    (out / "tls.key").write_bytes(key)


def write_pki(pki: Path, service_ip: str) -> None:
    """CA, apiserver serving cert, admin client cert (system:masters), service-account signing key."""
    pki.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = make_ca("tokenmill-e2e-ca")
    (pki / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (pki / "ca.key").write_bytes(_pem_key(ca_key))
    crt, key = _issue(ca_key, ca_cert, _name("kube-apiserver"), server_names=[
        "127.0.0.1", "localhost", service_ip, "kubernetes", "kubernetes.default", "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local"])
    (pki / "apiserver.crt").write_bytes(crt)
    (pki / "apiserver.key").write_bytes(key)
    crt, key = _issue(ca_key, ca_cert, _name("admin", "system:masters"), client=True)
    (pki / "admin.crt").write_bytes(crt)
    (pki / "admin.key").write_bytes(key)
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (pki / "sa.key").write_bytes(_pem_key(sa_key))
    (pki / "sa.pub").write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


def kubeconfig_yaml(server: str, ca_pem: bytes, user: dict, user_name: str = "admin") -> str:
    """A one-context kubeconfig with everything embedded (JSON is valid YAML)."""
    b64 = base64.b64encode(ca_pem).decode()
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "tokenmill-e2e",
        "clusters": [{"name": "tokenmill-e2e", "cluster": {"server": server, "certificate-authority-data": b64}}],
        "users": [{"name": user_name, "user": user}],
        "contexts": [{"name": "tokenmill-e2e", "context": {"cluster": "tokenmill-e2e", "user": user_name}}],
    }, indent=2)


def admin_kubeconfig(server: str, pki: Path) -> str:
    b64 = lambda p: base64.b64encode((pki / p).read_bytes()).decode()  # noqa: E731
    return kubeconfig_yaml(server, (pki / "ca.crt").read_bytes(),
                           {"client-certificate-data": b64("admin.crt"), "client-key-data": b64("admin.key")})
