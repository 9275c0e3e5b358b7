"""NATS authentication and TLS options without a server: the option parsing
(kvpush.shared.nats_security), the flags that carry them to child processes, and the dev
certificates (tools/dev_certs.py). tests/nats/test_nats_security.py has a real
nats-server enforce them."""

from __future__ import annotations

import argparse
import datetime
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from kvpush.tools import dev_certs
from kvpush.shared.errors import KvpushError
from kvpush.shared import nats_security
from kvpush.shared.nats_security import ENV_VARS, NatsConfigError, add_arguments, connect_options, export_arguments

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- connect_options


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    return dev_certs.generate(tmp_path_factory.mktemp("nats-secure") / "certs")


def tls_env(certs: Path, client_cert: bool = True) -> dict[str, str]:
    env = {"KVPUSH_NATS_TLS_CA": str(certs / "ca.pem")}
    if client_cert:
        env |= {"KVPUSH_NATS_TLS_CERT": str(certs / "client.pem"), "KVPUSH_NATS_TLS_KEY": str(certs / "client-key.pem")}
    return env


def test_nothing_set_means_no_options():
    assert connect_options({}) == {}
    assert connect_options({name: "" for name in ENV_VARS.values()}) == {}


def test_user_and_password():
    assert connect_options({"KVPUSH_NATS_USER": "u", "KVPUSH_NATS_PASSWORD": "p"}) == {
        "user": "u", "password": "p", "inbox_prefix": "_INBOX.u"}


def test_a_service_takes_replies_on_its_own_inbox_and_a_named_client_on_its_own():
    env = {"KVPUSH_NATS_USER": "decode-0", "KVPUSH_NATS_PASSWORD": "p"}
    assert connect_options(env, service="decode-0")["inbox_prefix"] == "_KVPUSH_INBOX.decode-0"
    assert connect_options(env)["inbox_prefix"] == "_INBOX.decode-0"
    assert "inbox_prefix" not in connect_options({})  # an anonymous client keeps nats-py's _INBOX


def test_token():
    assert connect_options({"KVPUSH_NATS_TOKEN": "t0k"}) == {"token": "t0k"}


def test_nkey_seed_and_creds_are_passed_as_paths(tmp_path):
    seed, creds = tmp_path / "user.nk", tmp_path / "user.creds"
    seed.write_text("SUAEXAMPLE")
    creds.write_text("-----BEGIN NATS USER JWT-----")
    assert connect_options({"KVPUSH_NATS_NKEY_SEED": str(seed)}) == {"nkeys_seed": str(seed)}
    assert connect_options({"KVPUSH_NATS_CREDS": str(creds)}) == {"user_credentials": str(creds)}


def test_tls_with_ca_verifies_the_server(certs):
    options = connect_options(tls_env(certs, client_cert=False))
    context = options.pop("tls")
    assert options == {}
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert [ca["subject"] for ca in context.get_ca_certs()] == [((("commonName", dev_certs.CA_NAME),),)]


def test_tls_client_certificate_without_ca_uses_system_trust(certs):
    env = {k: v for k, v in tls_env(certs).items() if k != "KVPUSH_NATS_TLS_CA"}
    context = connect_options(env)["tls"]
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_auth_and_tls_combine(certs):
    options = connect_options({"KVPUSH_NATS_TOKEN": "t"} | tls_env(certs))
    assert options["token"] == "t" and isinstance(options["tls"], ssl.SSLContext)


def _encrypted_key(tmp_path: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "x")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "enc.pem", tmp_path / "enc-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.BestAvailableEncryption(b"secret")))
    return cert_path, key_path


def _contradictions(certs: Path, tmp_path: Path) -> dict[str, tuple[dict[str, str], str]]:
    existing = str(certs / "ca.pem")
    missing = str(tmp_path / "absent.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    encrypted_cert, encrypted_key = _encrypted_key(tmp_path)
    return {
        "password without user": ({"KVPUSH_NATS_PASSWORD": "p"}, "KVPUSH_NATS_PASSWORD .* is set but KVPUSH_NATS_USER"),
        "user without password": ({"KVPUSH_NATS_USER": "u"}, "KVPUSH_NATS_USER .* is set but KVPUSH_NATS_PASSWORD"),
        "user and token": ({"KVPUSH_NATS_USER": "u", "KVPUSH_NATS_PASSWORD": "p", "KVPUSH_NATS_TOKEN": "t"},
                           "choose one way .*KVPUSH_NATS_USER .* and KVPUSH_NATS_TOKEN"),
        "token and nkey": ({"KVPUSH_NATS_TOKEN": "t", "KVPUSH_NATS_NKEY_SEED": existing},
                           "choose one way .*KVPUSH_NATS_TOKEN .* and KVPUSH_NATS_NKEY_SEED"),
        "nkey and creds": ({"KVPUSH_NATS_NKEY_SEED": existing, "KVPUSH_NATS_CREDS": existing},
                           "choose one way .*KVPUSH_NATS_NKEY_SEED .* and KVPUSH_NATS_CREDS"),
        "missing nkey seed": ({"KVPUSH_NATS_NKEY_SEED": missing}, "KVPUSH_NATS_NKEY_SEED .* names .* not a file"),
        "missing creds": ({"KVPUSH_NATS_CREDS": missing}, "KVPUSH_NATS_CREDS .* names .* not a file"),
        "missing ca": ({"KVPUSH_NATS_TLS_CA": missing}, "KVPUSH_NATS_TLS_CA .* names .* not a file"),
        "missing cert": ({"KVPUSH_NATS_TLS_CERT": missing, "KVPUSH_NATS_TLS_KEY": existing},
                         "KVPUSH_NATS_TLS_CERT .* names .* not a file"),
        "missing key": ({"KVPUSH_NATS_TLS_CERT": existing, "KVPUSH_NATS_TLS_KEY": missing},
                        "KVPUSH_NATS_TLS_KEY .* names .* not a file"),
        "cert without key": ({"KVPUSH_NATS_TLS_CERT": existing}, "KVPUSH_NATS_TLS_CERT .* is set but KVPUSH_NATS_TLS_KEY"),
        "key without cert": ({"KVPUSH_NATS_TLS_KEY": existing}, "KVPUSH_NATS_TLS_KEY .* is set but KVPUSH_NATS_TLS_CERT"),
        "ca is not PEM": ({"KVPUSH_NATS_TLS_CA": str(garbage)}, "TLS files could not be loaded"),
        "key does not match cert": ({"KVPUSH_NATS_TLS_CERT": str(certs / "client.pem"),
                                     "KVPUSH_NATS_TLS_KEY": str(certs / "server-key.pem")},
                                    "TLS files could not be loaded"),
        "encrypted key": ({"KVPUSH_NATS_TLS_CERT": str(encrypted_cert), "KVPUSH_NATS_TLS_KEY": str(encrypted_key)},
                          "KVPUSH_NATS_TLS_KEY .* is encrypted"),
    }


CONTRADICTIONS = ("password without user", "user without password", "user and token", "token and nkey",
                  "nkey and creds", "missing nkey seed", "missing creds", "missing ca", "missing cert", "missing key",
                  "cert without key", "key without cert", "ca is not PEM", "key does not match cert", "encrypted key")


@pytest.mark.parametrize("case", CONTRADICTIONS)
def test_contradictions_are_refused_with_a_sentence(case, certs, tmp_path):
    env, message = _contradictions(certs, tmp_path)[case]
    with pytest.raises(NatsConfigError, match=message) as caught:
        connect_options(env)
    assert isinstance(caught.value, KvpushError) and isinstance(caught.value, ValueError)
    assert caught.value.message.endswith(".")


def test_module_does_not_import_nats():
    code = "import sys, kvpush.shared.nats_security; assert 'nats' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# --------------------------------------------------------------------------- flags


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_default_to_none_and_name_their_variable():
    args = parse([])
    assert all(getattr(args, dest) is None for dest in ENV_VARS)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    for dest, env_name in ENV_VARS.items():
        assert f"--{dest.replace('_', '-')}" in help_text and env_name in help_text


def test_export_copies_given_flags_and_makes_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = parse(["--nats-user", "decode", "--nats-password", "pw", "--nats-tls-ca", "certs/ca.pem",
                  "--nats-tls-cert", "/abs/client.pem", "--nats-tls-key", "k.pem"])
    env = {"KVPUSH_NATS_TOKEN": "kept", "OTHER": "x"}
    export_arguments(args, env)
    assert env == {
        "OTHER": "x",
        "KVPUSH_NATS_TOKEN": "kept",
        "KVPUSH_NATS_USER": "decode",
        "KVPUSH_NATS_PASSWORD": "pw",
        "KVPUSH_NATS_TLS_CA": str(tmp_path / "certs" / "ca.pem"),
        "KVPUSH_NATS_TLS_CERT": "/abs/client.pem",
        "KVPUSH_NATS_TLS_KEY": str(tmp_path / "k.pem"),
    }


def test_every_flag_round_trips_through_the_environment(tmp_path):
    args = parse(["--nats-token", "t", "--nats-nkey-seed", str(tmp_path / "s.nk"), "--nats-creds", str(tmp_path / "c"),
                  "--nats-user", "u", "--nats-password", "p", "--nats-tls-ca", str(tmp_path / "ca"),
                  "--nats-tls-cert", str(tmp_path / "cert"), "--nats-tls-key", str(tmp_path / "key")])
    env: dict[str, str] = {}
    export_arguments(args, env)
    assert set(env) == set(ENV_VARS.values())
    assert env["KVPUSH_NATS_TOKEN"] == "t" and env["KVPUSH_NATS_CREDS"] == str(tmp_path / "c")


def test_export_reaches_child_processes(monkeypatch):
    monkeypatch.setenv("KVPUSH_NATS_TOKEN", "before")
    export_arguments(parse(["--nats-token", "inherited"]))
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['KVPUSH_NATS_TOKEN'])"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "inherited"


# --------------------------------------------------------------------------- dev certificates


def test_dev_certs_are_idempotent_and_chain_to_the_ca(tmp_path):
    folder = dev_certs.generate(tmp_path)
    before = {name: (folder / name).read_bytes() for name in dev_certs.FILES}
    dev_certs.generate(tmp_path)
    assert {name: (folder / name).read_bytes() for name in dev_certs.FILES} == before
    assert oct((folder / "server-key.pem").stat().st_mode & 0o777) == "0o600"
    _assert_chain(folder)


def test_dev_certs_openssl_fallback_chains_to_the_ca(tmp_path):
    if shutil.which("openssl") is None:
        with pytest.raises(RuntimeError, match="openssl"):
            dev_certs._generate_with_openssl(tmp_path, dev_certs.SERVER_IPS)
        return
    dev_certs._generate_with_openssl(tmp_path, dev_certs.SERVER_IPS + ("198.18.0.2",))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(dev_certs.FILES)
    _assert_chain(tmp_path)
    assert "198.18.0.2" in _server_ips(tmp_path)


def test_dev_certs_name_the_extra_server_addresses_of_a_multi_host_rig(tmp_path):
    folder = dev_certs.generate(tmp_path, server_ips=("198.18.0.1", "198.18.0.3"))
    assert _server_ips(folder) == {"127.0.0.1", "::1", "198.18.0.1", "198.18.0.3"}
    _assert_chain(folder)


def _server_ips(folder: Path) -> set[str]:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((folder / "server.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}


def _assert_chain(folder: Path) -> None:
    """Each leaf loads with its key, and (where openssl exists) verifies against the CA."""
    for leaf in ("server", "client"):
        ssl.create_default_context(cafile=str(folder / "ca.pem")).load_cert_chain(
            str(folder / f"{leaf}.pem"), str(folder / f"{leaf}-key.pem"))
        if shutil.which("openssl"):
            subprocess.run(["openssl", "verify", "-CAfile", str(folder / "ca.pem"), str(folder / f"{leaf}.pem")],
                           check=True, capture_output=True)


def test_one_url_or_a_cluster_list():
    assert nats_security.server_urls("nats://127.0.0.1:4222") == ["nats://127.0.0.1:4222"]
    assert nats_security.server_urls(" nats://198.18.0.1:4222, nats://198.18.0.2:4222 ,tls://h3:4222,") == [
        "nats://198.18.0.1:4222", "nats://198.18.0.2:4222", "tls://h3:4222"]


@pytest.mark.parametrize("urls", ["", " , ", "198.18.0.1:4222", "http://h:4222", "nats://h1:4222,ws://h2:80"])
def test_a_bad_url_list_is_refused_with_a_sentence(urls):
    with pytest.raises(nats_security.NatsConfigError, match="NATS URL"):
        nats_security.server_urls(urls)
