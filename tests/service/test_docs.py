"""``/docs`` and ``/redoc`` of a real server load nothing from outside it: every script,
style sheet and icon the pages name is a path on the server, served 200 (so the docs work
on an offline cluster), and the Swagger UI served renders OpenAPI 3.1 (version 5)."""
from __future__ import annotations

import re
from html.parser import HTMLParser

import httpx
import pytest
from server_harness import Server

ASSET_TYPES = {".js": "javascript", ".css": "text/css", ".png": "image/png"}


class _References(HTMLParser):
    """Every src and href in a page, and the URLs its inline scripts mention."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.refs += [value for name, value in attrs if name in ("src", "href") and value]
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.refs += re.findall(r"""url:\s*['"]([^'"]+)""", data)


def _references(html: str) -> list[str]:
    parser = _References()
    parser.feed(html)
    return parser.refs


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_docs_reference_only_the_servers_own_files(server: Server, page: str) -> None:
    response = httpx.get(server.url + page)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert "//" not in response.text, response.text  # no absolute or scheme-relative URL anywhere in the page
    refs = _references(response.text)
    assert refs, response.text
    for ref in refs:
        assert ref.startswith("/") and not ref.startswith("//"), ref
        asset = httpx.get(server.url + ref)
        assert asset.status_code == 200, ref
        kind = next((t for suffix, t in ASSET_TYPES.items() if ref.endswith(suffix)), "json")
        assert kind in asset.headers["content-type"], (ref, asset.headers["content-type"])
        assert len(asset.content) > 100, ref


def test_the_swagger_ui_served_renders_openapi_3_1(server: Server) -> None:
    refs = _references(httpx.get(f"{server.url}/docs").text)
    bundle = httpx.get(server.url + next(r for r in refs if r.endswith("swagger-ui-bundle.js"))).text
    assert "SwaggerUIBundle" in bundle
    versions = {tuple(map(int, v.split("."))) for v in re.findall(r'"(5\.\d+\.\d+)"', bundle)}
    assert versions, "not a Swagger UI 5 bundle (OpenAPI 3.1 needs 5)"
    assert httpx.get(f"{server.url}/openapi.json").json()["openapi"].startswith("3.1")


def test_the_oauth2_redirect_page_is_local_too(server: Server) -> None:
    response = httpx.get(f"{server.url}/docs/oauth2-redirect")
    assert response.status_code == 200
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", response.text)
