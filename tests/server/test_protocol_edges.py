"""Small HTTP edges (issue #37, row 10): HEAD answers wherever GET does (load balancers and
uptime checkers probe with HEAD), a compressed body is a 415 naming its encoding (not "not
valid JSON"), and a UTF-8 byte order mark before the JSON is ignored (RFC 8259 §8.1 lets a
parser ignore it)."""
from __future__ import annotations

import gzip
import json

import httpx
import pytest

from llmlab.server.app import create_app
from helpers.server import running, tiny_engine

BODY = {"prompt": "Hi", "max_tokens": 1}


@pytest.fixture(scope="module")
def app():
    return create_app(tiny_engine())


@pytest.fixture(scope="module")
def url(app):
    with running(app) as url:
        yield url


def test_every_get_route_answers_head(app, url):
    paths = app.openapi()["paths"]     # every route of the app and its routers, with its methods
    get_paths = {path for path, methods in paths.items() if "get" in methods} | {"/openapi.json"}
    assert {"/health", "/metrics", "/v1/models", "/v1/models/{name}"} <= get_paths
    for path in get_paths:
        path = path.replace("{name}", "tiny-random")
        head, get = httpx.head(f"{url}{path}"), httpx.get(f"{url}{path}")
        assert head.status_code == get.status_code == 200, path
        assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
    assert httpx.head(f"{url}/v1/models/gpt-9").status_code == 404


@pytest.mark.parametrize("encoding, compress", [("gzip", gzip.compress), ("br", lambda b: b),
                                                ("deflate", lambda b: b), ("gzip, identity", gzip.compress)])
def test_a_compressed_body_is_a_415_naming_its_encoding(url, encoding, compress):
    response = httpx.post(f"{url}/v1/completions", content=compress(json.dumps(BODY).encode()),
                          headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert encoding.split(",")[0] in error["message"] and error["code"] == "unsupported_media_type"


def test_identity_encoding_is_no_encoding(url):
    response = httpx.post(f"{url}/v1/completions", json=BODY, headers={"Content-Encoding": "identity"})
    assert response.status_code == 200, response.text


def test_a_leading_byte_order_mark_is_ignored(url):
    response = httpx.post(f"{url}/v1/completions", content=b"\xef\xbb\xbf" + json.dumps(BODY).encode(),
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    # only one, and only at the start: anything else is still not JSON
    for body in (b"\xef\xbb\xbf\xef\xbb\xbf" + json.dumps(BODY).encode(), b" \xef\xbb\xbf" + json.dumps(BODY).encode()):
        response = httpx.post(f"{url}/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
