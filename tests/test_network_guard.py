"""Browser and network safety over HTTP (issue 16, section 2): foreign origins refused and allowed ones
answered with CORS headers (preflight too), a rebinding Host refused on a loopback server, CORRAL_API_KEY."""

import httpx
import pytest
from conftest import copy_store

from corral.server.guard import API_KEY_ENV, Guard, exposure_warning
from corral.server.serve import serve
from corral.store import Store

KEY = "s3cret-key"


async def start(nursery, tiny_store_root, tmp_path) -> str:
    address = await nursery.start(serve, "127.0.0.1", 0, Store(copy_store(tiny_store_root, tmp_path / "models")))
    return f"http://{address}"


@pytest.fixture
async def url(monkeypatch, nursery, tiny_store_root, tmp_path):
    for name in (API_KEY_ENV, "CORRAL_ORIGINS", "OLLAMA_ORIGINS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OLLAMA_ORIGINS", "https://app.example, https://*.trusted.example")
    return await start(nursery, tiny_store_root, tmp_path)


@pytest.fixture
async def keyed_url(monkeypatch, nursery, tiny_store_root, tmp_path):
    monkeypatch.setenv(API_KEY_ENV, KEY)
    return await start(nursery, tiny_store_root, tmp_path)


async def get(url: str, path: str = "/api/tags", method: str = "GET", **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return await client.request(method, path, headers={key.replace("_", "-"): value for key, value in headers.items()})


async def test_a_request_without_an_origin_is_served(url):
    response = await get(url)
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


async def test_a_foreign_origin_is_refused_without_cors_headers(url):
    response = await get(url, Origin="https://evil.example")
    assert response.status_code == 403
    assert "CORRAL_ORIGINS" in response.json()["error"]
    assert "access-control-allow-origin" not in response.headers


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1", "app://obsidian.md", "https://app.example",
                                    "https://ui.trusted.example"])  # fmt: skip
async def test_loopback_app_and_listed_origins_get_cors_headers(url, origin):
    response = await get(url, Origin=origin)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == origin


async def test_a_preflight_from_an_allowed_origin_is_answered(url):
    response = await get(url, "/api/chat", "OPTIONS", Origin="http://localhost:5173", Access_Control_Request_Method="POST",
                         Access_Control_Request_Headers="content-type, authorization")  # fmt: skip
    assert response.status_code == 204
    assert response.headers["access-control-allow-origin"] == "http://localhost:5173"
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "authorization" in response.headers["access-control-allow-headers"].lower()


async def test_a_preflight_from_a_foreign_origin_is_refused(url):
    response = await get(url, "/api/chat", "OPTIONS", Origin="https://evil.example", Access_Control_Request_Method="POST")
    assert response.status_code == 403 and "access-control-allow-origin" not in response.headers


@pytest.mark.parametrize("host", ["evil.example", "evil.example:11434", "attacker.com."])
async def test_a_rebinding_host_is_refused_on_a_loopback_server(url, host):
    response = await get(url, Host=host)
    assert response.status_code == 403
    assert "Host" in response.json()["error"]


@pytest.mark.parametrize("host", ["localhost:11434", "127.0.0.1", "[::1]:8080", "box.local", "192.168.1.20:11434"])
async def test_hosts_naming_this_machine_are_served(url, host):
    assert (await get(url, Host=host)).status_code == 200


async def test_an_exposed_server_accepts_any_host():
    assert Guard.from_env("0.0.0.0").host_allowed("my-server.example:11434")


async def test_without_the_key_a_keyed_server_answers_401(keyed_url):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = await get(keyed_url, **headers)
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert KEY not in response.text
    openai = await get(keyed_url, "/v1/models")
    assert openai.status_code == 401 and openai.json()["error"]["type"] == "authentication_error"


async def test_with_the_key_a_keyed_server_answers(keyed_url):
    assert (await get(keyed_url, Authorization=f"Bearer {KEY}")).status_code == 200


async def test_liveness_needs_no_key(keyed_url):
    assert (await get(keyed_url, "/health")).status_code == 200
    assert (await get(keyed_url, "/")).status_code == 200


async def test_the_openai_client_sends_the_key(keyed_url):
    import openai

    good = openai.AsyncOpenAI(base_url=f"{keyed_url}/v1", api_key=KEY)
    assert [model.id async for model in good.models.list()]
    bad = openai.AsyncOpenAI(base_url=f"{keyed_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()


def test_binding_beyond_loopback_without_a_key_is_warned_about():
    warning = exposure_warning("0.0.0.0", None)
    assert warning is not None and API_KEY_ENV in warning
    assert exposure_warning("0.0.0.0", KEY) is None
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None
