"""TLS of the base layer's HTTP helper, over real sockets with certificates made here.

A server with mTLS accepts a client with the right CA and certificate and names it by the
certificate's common name; every wrong combination is refused with a clear error and the handler
never runs.
"""

from __future__ import annotations

import asyncio
import datetime

import pytest
from aiohttp import web

from deltamesh.certs import issue, make_ca
from deltamesh.http import HttpError, client_session, request_json, serving
from deltamesh.tls import TlsError, TlsSettings, check_token_transport, peer_identity, server_context


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = make_ca(root / "ca")
    other_ca = make_ca(root / "other-ca", name="someone else's CA")
    return {
        "ca": ca,
        "stranger_ca": other_ca,
        "server": issue(ca, root, "gateway/origin", hosts=["127.0.0.1", "localhost"]),
        "client": issue(ca, root, "pool/eu-1"),
        "stranger": issue(other_ca, root, "pool/stranger"),
        "wrong_host": issue(ca, root, "gateway/elsewhere", hosts=["elsewhere.example"]),
        "expired": issue(ca, root, "gateway/old", hosts=["127.0.0.1"],
                         not_before=datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc), days=30),
    }


def settings(pki, cert=None, *, ca="ca", client_ca=None) -> TlsSettings:
    return TlsSettings(cert=str(pki[cert].cert) if cert else "", key=str(pki[cert].key) if cert else "",
                       ca=str(pki[ca].cert) if ca else "", client_ca=str(pki[client_ca].cert) if client_ca else "")


def app_recording(calls: list) -> web.Application:
    async def who(request: web.Request) -> web.Response:
        calls.append(peer_identity(request.transport))
        return web.json_response({"peer": calls[-1]})

    app = web.Application()
    app.router.add_get("/who", who)
    return app


def run_with_server(server_tls: TlsSettings | None, body, calls: list | None = None):
    calls = [] if calls is None else calls

    async def go():
        ctx = server_context(server_tls) if server_tls else None
        async with serving(app_recording(calls), "127.0.0.1:0", ssl_context=ctx) as url:
            return await body(url), calls
    return asyncio.run(go())


async def get(url: str, tls: TlsSettings | None):
    async with client_session(tls=tls, timeout_s=10) as s:
        return await request_json(s, "GET", f"{url}/who")


def test_mtls_names_the_client_by_its_certificate(pki):
    answer, calls = run_with_server(settings(pki, "server", client_ca="ca"),
                                    lambda url: get(url, settings(pki, "client")))
    assert answer == {"peer": "pool/eu-1"} and calls == ["pool/eu-1"]


@pytest.mark.parametrize("server_cert, client_cert, client_ca, expected", [
    ("server", None, "ca", "may require a client certificate"),  # mTLS server, client presents no certificate
    ("server", "stranger", "ca", "may require a client certificate"),  # client certificate from another CA
    ("server", "client", "stranger_ca", "certificate verify failed"),  # client trusts another CA
    ("wrong_host", "client", "ca", "address mismatch"),      # server certificate for another host
    ("expired", "client", "ca", "certificate has expired"),
])
def test_wrong_certificates_are_refused_before_the_handler(pki, server_cert, client_cert, client_ca, expected):
    calls: list = []
    with pytest.raises(HttpError) as e:
        run_with_server(settings(pki, server_cert, client_ca="ca"),
                        lambda url: get(url, settings(pki, client_cert, ca=client_ca)), calls)
    assert e.value.status == 0 and calls == []
    assert expected in str(e.value).lower(), str(e.value)


def test_plain_http_against_tls_and_the_reverse_fail_clearly(pki):
    with pytest.raises(HttpError) as e:
        run_with_server(settings(pki, "server"), lambda url: get(url.replace("https://", "http://"), None))
    assert e.value.status in (0, 400)
    with pytest.raises(HttpError) as e:
        run_with_server(None, lambda url: get(url.replace("http://", "https://"), settings(pki, "client")))
    assert e.value.status == 0 and "ssl" in str(e.value).lower()


def test_tokens_never_go_in_clear_text_to_remote_hosts():
    check_token_transport("https://gw.example:8700", insecure=False)
    check_token_transport("http://127.0.0.1:8700", insecure=False)
    check_token_transport("http://[::1]:8700", insecure=False)
    check_token_transport("http://localhost:8700", insecure=False)
    check_token_transport("http://gw.example:8700", insecure=True)
    with pytest.raises(TlsError, match="refusing to send a token over plain http"):
        check_token_transport("http://gw.example:8700", insecure=False)
    with pytest.raises(TlsError):
        check_token_transport("http://10.1.2.3:8700", insecure=False)


def test_settings_are_checked(pki, tmp_path):
    with pytest.raises(ValueError, match="cert and key go together"):
        TlsSettings(cert=str(pki["server"].cert))
    with pytest.raises(ValueError, match="is not a file"):
        TlsSettings(ca=str(tmp_path / "missing.pem"))
    with pytest.raises(TlsError, match="needs a server certificate"):
        server_context(TlsSettings(client_ca=str(pki["ca"].cert)))
    with pytest.raises(TlsError, match="cannot load tls cert"):
        server_context(TlsSettings(cert=str(pki["server"].cert), key=str(pki["client"].key)))
