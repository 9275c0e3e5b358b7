"""Generate a throw-away certificate authority, a server certificate and a client
certificate, so a NATS server with TLS (deploy/nats-server.conf) can be tried locally.

    python -m kvpush.tools.dev_certs [FOLDER]        # default: deploy/certs/
    (or: from kvpush.tools.dev_certs import generate)

Writes ca.pem, ca-key.pem, server.pem, server-key.pem (for 127.0.0.1 and localhost, and
the names given with --server-names; good for client authentication too, so that NATS
servers can use it on the routes between them), client.pem, client-key.pem. Idempotent:
when all six files exist nothing is rewritten (pass --force to regenerate). Uses the
``cryptography`` package when it is installed and the ``openssl`` command otherwise.
These are development certificates only: the CA key lies next to the certificates it
signed.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_FOLDER = Path(__file__).resolve().parent.parent / "deploy" / "certs"
FILES = ("ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem")
SERVER_NAMES = ("localhost",)
SERVER_IPS = ("127.0.0.1", "::1")
VALID_DAYS = 825
CA_NAME = "kvpush dev CA"
SERVER_NAME = "kvpush nats-server"
CLIENT_NAME = "kvpush client"


def generate(folder: Path | str = DEFAULT_FOLDER, force: bool = False, server_ips: tuple[str, ...] = (),
             server_names: tuple[str, ...] = ()) -> Path:
    """Make sure ``folder`` holds the six PEM files; return the folder. ``server_ips``:
    addresses the server certificate is valid for besides loopback (the multi-host rig's
    NATS servers); ``server_names``: DNS names besides localhost (``nats`` under docker
    compose, ``*.nats`` in Kubernetes)."""
    ips = SERVER_IPS + tuple(server_ips)
    names = SERVER_NAMES + tuple(n for n in server_names if n not in SERVER_NAMES)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not force and all((folder / name).exists() for name in FILES):
        return folder
    try:
        import cryptography  # noqa: F401
    except ImportError:
        _generate_with_openssl(folder, ips, names)
    else:
        _generate_with_cryptography(folder, ips, names)
    for name in FILES:
        if name.endswith("-key.pem"):
            os.chmod(folder / name, 0o600)
    return folder


# --------------------------------------------------------------------------- cryptography


def _generate_with_cryptography(folder: Path, ips: tuple[str, ...], names: tuple[str, ...] = SERVER_NAMES) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def write_key(key, path: Path) -> None:
        path.write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))

    def builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.timezone.utc)
        return (x509.CertificateBuilder()
                .subject_name(name(subject)).issuer_name(issuer).public_key(public_key)
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=VALID_DAYS)))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (builder(CA_NAME, name(CA_NAME), ca_key.public_key())
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(_key_usage(x509, cert_sign=True), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))
    write_key(ca_key, folder / "ca-key.pem")
    (folder / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))

    leaves = {
        "server": (SERVER_NAME, [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                   x509.SubjectAlternativeName(
            [x509.DNSName(n) for n in names] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips])),
        "client": (CLIENT_NAME, [ExtendedKeyUsageOID.CLIENT_AUTH], x509.SubjectAlternativeName(
            [x509.DNSName("kvpush-client")])),
    }
    for stem, (common_name, usages, alt_names) in leaves.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (builder(common_name, ca_cert.subject, key.public_key())
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(_key_usage(x509, cert_sign=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
                .add_extension(alt_names, critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
                .sign(ca_key, hashes.SHA256()))
        write_key(key, folder / f"{stem}-key.pem")
        (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _key_usage(x509, cert_sign: bool):
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign, crl_sign=cert_sign,
        encipher_only=False, decipher_only=False)


# --------------------------------------------------------------------------- openssl CLI


def _generate_with_openssl(folder: Path, ips: tuple[str, ...], names: tuple[str, ...] = SERVER_NAMES) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("neither the cryptography package nor the openssl command is available")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True)

    def new_key(path: Path) -> None:
        run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))

    new_key(folder / "ca-key.pem")
    run("req", "-x509", "-new", "-key", str(folder / "ca-key.pem"), "-sha256", "-days", str(VALID_DAYS),
        "-subj", f"/CN={CA_NAME}", "-out", str(folder / "ca.pem"),
        "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
        "-addext", "keyUsage=critical,digitalSignature,keyCertSign,cRLSign")

    server_alt = ",".join([f"DNS:{n}" for n in names] + [f"IP:{i}" for i in ips])
    leaves = {
        "server": (SERVER_NAME, "serverAuth,clientAuth", server_alt),
        "client": (CLIENT_NAME, "clientAuth", "DNS:kvpush-client"),
    }
    with tempfile.TemporaryDirectory() as scratch:
        for stem, (common_name, usage, alt_names) in leaves.items():
            key, csr, ext = folder / f"{stem}-key.pem", Path(scratch) / f"{stem}.csr", Path(scratch) / f"{stem}.ext"
            ext.write_text(
                "basicConstraints=critical,CA:FALSE\n"
                "keyUsage=critical,digitalSignature\n"
                f"extendedKeyUsage={usage}\n"
                f"subjectAltName={alt_names}\n")
            new_key(key)
            run("req", "-new", "-key", str(key), "-subj", f"/CN={common_name}", "-out", str(csr))
            run("x509", "-req", "-in", str(csr), "-CA", str(folder / "ca.pem"), "-CAkey", str(folder / "ca-key.pem"),
                "-CAcreateserial", "-sha256", "-days", str(VALID_DAYS), "-extfile", str(ext),
                "-out", str(folder / f"{stem}.pem"))
    (folder / "ca.srl").unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", default=str(DEFAULT_FOLDER), help=f"where to write (default {DEFAULT_FOLDER})")
    parser.add_argument("--force", action="store_true", help="regenerate even if the files exist")
    parser.add_argument("--server-ips", default="", metavar="IP,IP",
                        help="more addresses the server certificate is valid for (NATS servers on other hosts)")
    parser.add_argument("--server-names", default="", metavar="NAME,NAME",
                        help="more DNS names the server certificate is valid for (nats, *.nats, ...)")
    args = parser.parse_args(argv)
    ips = tuple(ip.strip() for ip in args.server_ips.split(",") if ip.strip())
    names = tuple(name.strip() for name in args.server_names.split(",") if name.strip())
    folder = generate(args.folder, force=args.force, server_ips=ips, server_names=names)
    print(f"dev certificates in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
