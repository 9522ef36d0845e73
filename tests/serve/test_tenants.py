"""Keys and tenants: tenant B never sees, continues, deletes or lists tenant A's
conversation, whatever ids and headers it sends (hypothesis, and schemathesis against the
OpenAPI schema: no 5xx, no leak)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import schemathesis
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatctx.cli import cli
from tests.serve.conftest import ServerProcess

KEY_A = "sk-acme-0123456789"
KEY_B = "sk-globex-9876543210"
KEYS = {KEY_A: "acme", KEY_B: "globex"}
SECRET = "SECRET-acme-7f3e9 the vault code is 2291"
A_ID = "cust-1"


def auth(key: str) -> dict[str, Any]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed(
    tiny_llama3_path: Path, embedder_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, list[str]]]:
    """A server with two tenants; acme has one conversation holding SECRET."""
    folder = tmp_path_factory.mktemp("keyed")
    server = ServerProcess(
        folder,
        tiny_llama3_path,
        "--n-ctx",
        "512",
        "--slots",
        "2",
        "--request-timeout",
        "2",
        keys=KEYS,
        env={"CHATCTX_HOME": str(folder / "home"), "CHATCTX_EMBEDDER": str(embedder_path)},
    )
    replies = []
    for text in (SECRET, "second message of acme"):
        response = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": text}],
                "conversation": A_ID,
                "max_tokens": 6,
            },
            headers=auth(KEY_A),
            timeout=60,
        )
        assert response.status_code == 200, response.text
        replies.append(response.json()["choices"][0]["message"]["content"])
    yield server, [r for r in replies if len(r.strip()) >= 8]
    server.stop()


def secrets_in(text: str, replies: list[str]) -> list[str]:
    return [s for s in [SECRET, *replies] if s in text]


def a_history(server: ServerProcess) -> list[tuple[str, str]]:
    with server.store() as store:
        return [(m.role, m.content) for m in store.messages(f"acme:{A_ID}")]


def test_keys_are_required_and_checked(keyed: tuple[ServerProcess, list[str]]) -> None:
    server, _ = keyed
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY_A}):
        response = httpx.get(f"{server.url}/v1/conversations", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key


def test_another_tenant_gets_404_and_an_empty_list(
    keyed: tuple[ServerProcess, list[str]],
) -> None:
    server, replies = keyed
    before = a_history(server)
    assert before[0] == ("user", SECRET)
    mine = httpx.get(f"{server.url}/v1/conversations/{A_ID}", headers=auth(KEY_A))
    assert mine.status_code == 200 and SECRET in mine.text
    for suffix in ("", "/export", "/inspect", "/stats"):
        theirs = httpx.get(f"{server.url}/v1/conversations/{A_ID}{suffix}", headers=auth(KEY_B))
        assert theirs.status_code == 404
        assert theirs.json()["error"]["code"] == "conversation_not_found"
        assert not secrets_in(theirs.text, replies)
    assert (
        httpx.delete(f"{server.url}/v1/conversations/{A_ID}", headers=auth(KEY_B)).status_code
        == 404
    )
    listed = httpx.get(f"{server.url}/v1/conversations", headers=auth(KEY_B)).json()
    assert listed["data"] == []
    # "Continuing" A's id as B opens B's own conversation: A's history is not in its prompt.
    continued = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "what is the vault code?"}],
            "conversation": A_ID,
            "max_tokens": 4,
        },
        headers=auth(KEY_B),
        timeout=60,
    )
    assert continued.status_code == 200
    assert not secrets_in(continued.text, replies)
    with server.store() as store:
        b_turns = store.turns(f"globex:{A_ID}")
        a_turns = store.turns(f"acme:{A_ID}")
    assert len(b_turns) == 1 and b_turns[0].prompt_tokens < a_turns[-1].prompt_tokens
    assert continued.json()["usage"]["prompt_tokens"] == b_turns[0].prompt_tokens
    assert a_history(server) == before
    # The cache page names only B's own conversations.
    cache = httpx.get(f"{server.url}/v1/cache", headers=auth(KEY_B)).json()
    named = {s["conversation"] for s in cache["slots"]} - {None}
    assert named <= {A_ID}  # B's own "cust-1", never "acme:..."
    assert "acme" not in httpx.get(f"{server.url}/v1/cache", headers=auth(KEY_B)).text
    assert all(r["conversation"] == A_ID for r in cache["recent_turns"])
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "acme" not in metrics and 'conversation="' not in metrics  # keys: no ids there


ids = st.one_of(
    st.sampled_from(
        [
            A_ID,
            A_ID.upper(),
            f"acme:{A_ID}",
            f"acme%3A{A_ID}",
            f"{A_ID}%00",
            f"..%2F{A_ID}",
            f"{A_ID}/",
            f" {A_ID}",
            f"globex:{A_ID}",
            quote(f"acme:{A_ID}", safe=""),
        ]
    ),
    st.text(min_size=1, max_size=40),
)
headers = st.one_of(
    st.just(auth(KEY_B)),
    st.just({}),
    st.builds(
        lambda k: {"Authorization": k.encode("latin-1")},
        st.text(st.characters(max_codepoint=255), max_size=40),
    ),
    st.sampled_from(
        [
            {"Authorization": f"Bearer {KEY_A[:-1]}"},
            {"Authorization": f"Bearer {KEY_A} "},
            {"Authorization": "Bearer acme"},
            {"Authorization": f"bearer {KEY_B}", "X-Tenant": "acme"},
            {"Authorization": f"Basic {KEY_A}"},
            {**auth(KEY_B), "X-Forwarded-For": "127.0.0.1", "X-Tenant": "acme"},
        ]
    ),
)
operations = st.sampled_from(["get", "delete", "export", "inspect", "stats", "list", "chat"])


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(conversation=ids, header=headers, operation=operations)
def test_fuzzed_ids_and_headers_never_leak(
    keyed: tuple[ServerProcess, list[str]],
    conversation: str,
    header: dict[str, Any],
    operation: str,
) -> None:
    server, replies = keyed
    safe = quote(conversation, safe="%:/")
    base = f"{server.url}/v1/conversations/{safe}"
    try:
        if operation == "list":
            response = httpx.get(
                f"{server.url}/v1/conversations",
                params={"after": conversation[:128]},
                headers=header,
            )
        elif operation == "chat":
            response = httpx.post(
                f"{server.url}/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "tell me the vault code"}],
                    "conversation": conversation,
                    "max_tokens": 1,
                },
                headers=header,
                timeout=60,
            )
        elif operation == "delete":
            response = httpx.delete(base, headers=header)
        else:
            suffix = "" if operation == "get" else f"/{operation}"
            response = httpx.get(base + suffix, headers=header)
    except httpx.InvalidURL:
        return  # not a request a client can send
    except httpx.LocalProtocolError:
        return  # a header httpx itself refuses to send
    assert response.status_code < 500, response.text
    assert not secrets_in(response.text, replies)
    if response.status_code == 200 and operation == "list":
        # Each listed id is one of the caller's own conversations (globex may well name one
        # "acme..." itself: the fuzzed chats create such ids), never acme's.
        tenant = "globex" if KEY_B in header.get("Authorization", "") else "acme"
        with server.store() as store:
            for c in response.json()["data"]:
                assert store.has_conversation(f"{tenant}:{c['id']}"), (tenant, c["id"])
    assert a_history(server)[0] == ("user", SECRET)


def _schema_cases(server: ServerProcess) -> Any:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    return schema.as_strategy()


def test_schemathesis_no_server_errors_no_leaks(keyed: tuple[ServerProcess, list[str]]) -> None:
    server, replies = keyed
    before = a_history(server)
    seen: list[int] = []

    @settings(
        max_examples=150,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    @given(case=_schema_cases(server), header=st.sampled_from([auth(KEY_B), {}]))
    def check(case: Any, header: dict[str, str]) -> None:
        response = case.call(headers=header, timeout=60)
        seen.append(response.status_code)
        assert response.status_code < 500, (case.method, case.formatted_path, response.text)
        assert not secrets_in(response.text, replies), (case.method, case.formatted_path)

    check()
    assert a_history(server) == before
    assert any(code == 200 for code in seen) and any(code == 404 for code in seen)


def test_no_keys_means_loopback_only(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0", "--port", "1"])
    assert result.exit_code == 1
    assert "refusing to listen on 0.0.0.0 without API keys" in result.output
    bad = tmp_path / "keys.json"
    bad.write_text('{"k1": "bad tenant"}')
    result = CliRunner().invoke(cli, ["serve", "--api-keys", str(bad), "--port", "1"])
    assert result.exit_code == 1 and "tenant 'bad tenant'" in result.output
    result = CliRunner().invoke(cli, ["serve", "--backend", "http://127.0.0.1:1", "--port", "1"])
    assert (
        result.exit_code == 1 and "no llama-server answers at http://127.0.0.1:1" in result.output
    )


def test_responses_and_conversations_are_the_tenants_own(
    keyed: tuple[ServerProcess, list[str]],
) -> None:
    server, _ = keyed
    secret = "SECRET-acme-responses: the safe opens with 8812"
    made = httpx.post(
        f"{server.url}/v1/responses",
        json={"input": secret, "max_output_tokens": 4, "truncation": "auto"},
        headers=auth(KEY_A),
        timeout=60,
    )
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    conversation = httpx.post(
        f"{server.url}/v1/conversations",
        json={"items": [{"role": "user", "content": secret}]},
        headers=auth(KEY_A),
    ).json()["id"]
    base = f"{server.url}/v1/responses/{response_id}"
    tried = [
        httpx.get(base, headers=auth(KEY_B)),
        httpx.get(f"{base}/input_items", headers=auth(KEY_B)),
        httpx.delete(base, headers=auth(KEY_B)),
        httpx.get(f"{server.url}/v1/conversations/{conversation}/items", headers=auth(KEY_B)),
        httpx.post(
            f"{server.url}/v1/conversations/{conversation}",
            json={"metadata": {"x": "y"}},
            headers=auth(KEY_B),
        ),
    ]
    for key, value in (("previous_response_id", response_id), ("conversation", conversation)):
        body = {"input": "tell me the secret", "max_output_tokens": 4, key: value}
        tried.append(
            httpx.post(f"{server.url}/v1/responses", json=body, headers=auth(KEY_B), timeout=60)
        )
        tried.append(
            httpx.post(f"{server.url}/v1/responses/input_tokens", json=body, headers=auth(KEY_B))
        )
    for answer in tried:
        assert answer.status_code == 404, (answer.request.url, answer.text)
        assert secret not in answer.text
    # Acme's own are untouched and readable by acme.
    assert httpx.get(base, headers=auth(KEY_A)).json()["id"] == response_id
    items = httpx.get(
        f"{server.url}/v1/conversations/{conversation}/items", headers=auth(KEY_A)
    ).json()
    assert [i["content"][0]["text"] for i in items["data"]] == [secret]
