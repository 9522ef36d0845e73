import io
import json

import pytest

from chatctx.errors import ImportFormatError
from chatctx.store import Store, export_jsonl, import_records, read_jsonl

CONVERSATION = {
    "id": "c-1",
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris? ☀️ 한국어"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "21C", "tool_call_id": "call_1", "name": "weather"},
        {"role": "assistant", "content": "21 °C and sunny.", "status": "partial"},
    ],
    "title": "paris",
    "settings": {"generation": {"max_tokens": 12}},
}


def test_export_import_round_trips_exactly(db_url: str, tmp_path) -> None:
    line = json.dumps(CONVERSATION)
    with Store(db_url) as store:
        import_records(store, read_jsonl([line]))
        out = io.StringIO()
        export_jsonl(store, ["c-1"], out)
    assert json.loads(out.getvalue()) == CONVERSATION
    # and into a second database, again
    with Store(f"sqlite:///{tmp_path / 'other.db'}") as other:
        import_records(other, read_jsonl(out.getvalue().splitlines()))
        again = io.StringIO()
        export_jsonl(other, ["c-1"], again)
    assert again.getvalue() == out.getvalue()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"id": "x"}', 'non-empty "messages"'),
        ('{"id": "x", "messages": [{"role": "robot", "content": "hi"}]}', "unknown role"),
        ('{"id": "x", "messages": [{"role": "user", "content": 3}]}', "content must be"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_malformed_line_names_the_line_and_stores_nothing(
    db_url: str, bad: str, message: str
) -> None:
    lines = [json.dumps(CONVERSATION), "", bad]
    with Store(db_url) as store:
        with pytest.raises(ImportFormatError, match=message) as info:
            import_records(store, read_jsonl(lines, source="in.jsonl"))
        assert info.value.line == 3
        assert str(info.value).startswith("in.jsonl:3:")
        assert store.list_conversations() == []


def test_existing_id_is_refused_and_nothing_changes(db_url: str) -> None:
    with Store(db_url) as store:
        store.create_conversation("c-1")
        with pytest.raises(ImportFormatError, match="already exists"):
            import_records(store, read_jsonl([json.dumps(CONVERSATION)]))
        assert store.messages("c-1") == []
