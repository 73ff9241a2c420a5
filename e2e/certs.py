"""Key material for the e2e control plane: a CA, serving certificates and the service-account key pair.

Everything is self-signed and short-lived (one cluster run); written with `cryptography` so the
cluster needs no openssl configuration files.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Names under which in-cluster clients reach the apiserver (the first service IP is 10.0.0.1
# with --service-cluster-ip-range=10.0.0.0/24); tests and components use 127.0.0.1.
APISERVER_DNS = [
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
]
APISERVER_IPS = ["127.0.0.1", "10.0.0.1"]


def _write_key(path: Path, key) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    path.write_bytes(pem)
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return builder.not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(
        now + datetime.timedelta(days=30)
    )


def _make_ca(name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
    )
    return key, _validity(builder).sign(key, hashes.SHA256())


def _make_leaf(ca_key, ca_cert, common_name: str, dns: list[str], ips: list[str], usages):
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, _validity(builder).sign(ca_key, hashes.SHA256())


def make_pki(pki_dir: Path) -> dict[str, Path]:
    """Write every key and certificate the cluster needs into pki_dir; return their paths by role."""
    pki_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "ca_crt": pki_dir / "ca.crt",
        "ca_key": pki_dir / "ca.key",
        "apiserver_crt": pki_dir / "apiserver.crt",
        "apiserver_key": pki_dir / "apiserver.key",
        "kubelet_client_crt": pki_dir / "apiserver-kubelet-client.crt",
        "kubelet_client_key": pki_dir / "apiserver-kubelet-client.key",
        "agent_crt": pki_dir / "node-agent.crt",
        "agent_key": pki_dir / "node-agent.key",
        "sa_key": pki_dir / "sa.key",
        "sa_pub": pki_dir / "sa.pub",
    }
    ca_key, ca_cert = _make_ca("pagefleet-e2e-ca")
    _write_key(paths["ca_key"], ca_key)
    _write_cert(paths["ca_crt"], ca_cert)

    server = [ExtendedKeyUsageOID.SERVER_AUTH]
    key, cert = _make_leaf(ca_key, ca_cert, "kube-apiserver", APISERVER_DNS, APISERVER_IPS, server)
    _write_key(paths["apiserver_key"], key)
    _write_cert(paths["apiserver_crt"], cert)

    # The apiserver presents this to the node agent's log endpoint (kubectl logs).
    client = [ExtendedKeyUsageOID.CLIENT_AUTH]
    key, cert = _make_leaf(ca_key, ca_cert, "kube-apiserver-kubelet-client", [], [], client)
    _write_key(paths["kubelet_client_key"], key)
    _write_cert(paths["kubelet_client_crt"], cert)

    key, cert = _make_leaf(ca_key, ca_cert, "pagefleet-node-agent", ["localhost"], ["127.0.0.1"], server)
    _write_key(paths["agent_key"], key)
    _write_cert(paths["agent_crt"], cert)

    # Service-account tokens are signed with RSA (the apiserver's default for --service-account-*).
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(paths["sa_key"], sa_key)
    paths["sa_pub"].write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return paths
