"""A slot given to another conversation, saved to the server's --slot-save-path and restored.

One conversation slot (and the summary slot) on a real llama-server with its host-RAM prompt
cache off: customer A's second turn comes after customer B took A's slot. The oracle is the
server's own ``cache_n`` against A's first prompt (a prefix of its second), and the same
conversation without ``swap``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from chatctx import ChatSession, ConfigError
from chatctx.backends.llama_server import LlamaServerBackend
from chatctx.backends.llama_server._slot_files import DROPPED, swap_filename
from chatctx.settings import GenerationSettings
from tests.llama_server.conftest import start_server

pytestmark = pytest.mark.slow

GREEDY = GenerationSettings(max_tokens=8, temperature=0.0, repeat_penalty=1.0)
SYSTEM = "You are the support assistant of a small online bookshop. Be brief and polite."


def test_a_slot_taken_by_another_customer_comes_back_from_its_file(
    llama_server_binary: Path, smollm2_path: Path, tmp_path: Path, db_url: str
) -> None:
    server = start_server(llama_server_binary, smollm2_path, tmp_path / "server", slots=2)
    assert server.slot_save_path is not None
    seen = {}
    try:
        for swap in (False, True):
            with LlamaServerBackend(
                server.url, model=smollm2_path, slot_save_path=server.slot_save_path, swap=swap
            ) as backend:
                assert backend.slots == 1  # and one slot kept for summaries
                backend.clear()
                a, b = f"a-{swap}", f"b-{swap}"
                with (
                    ChatSession.open(
                        db_url, conversation_id=a, backend=backend, system_prompt=SYSTEM,
                        settings=GREEDY,
                    ) as first_customer,
                    ChatSession.open(
                        db_url, conversation_id=b, backend=backend, system_prompt=SYSTEM,
                        settings=GREEDY,
                    ) as second_customer,
                ):  # fmt: skip
                    first = first_customer.send("My order NH-4821 has not arrived yet.")
                    second_customer.send("Hello, when do you open on Sundays?")  # takes A's slot
                    again = first_customer.send("Could you check where it is?")
                assert first.turn is not None and again.turn is not None
                seen[swap] = (first.turn, again.turn)
                if swap:
                    swapped = server.slot_save_path / swap_filename(a)
                    assert swapped.stat().st_size > 0
                    backend.forget(a)  # a server on this machine: its file goes too
                    assert not swapped.exists()
    finally:
        server.stop()
    # Without swap the slot held B's prompt: A's second turn reused the shared system
    # prompt only, and the record says why it prefilled again.
    was, now = seen[False]
    assert now.reused_tokens < was.prompt_tokens
    assert now.swap_in is None and now.reprefill_reason is not None
    # With swap A's first prompt and reply came back from the file: the server reused all of
    # the first prompt (a prefix of the second) by its own count.
    was, now = seen[True]
    assert now.reused_tokens >= was.prompt_tokens
    assert now.swap_in == "disk" and now.reprefill_reason is None
    assert now.swap_in_bytes is not None and now.swap_in_bytes > 0


def test_a_swap_file_gone_meanwhile_costs_a_prefill_not_the_turn(
    llama_server_binary: Path, smollm2_path: Path, tmp_path: Path, db_url: str
) -> None:
    server = start_server(llama_server_binary, smollm2_path, tmp_path / "server", slots=2)
    assert server.slot_save_path is not None
    try:
        with (
            LlamaServerBackend(
                server.url, model=smollm2_path, slot_save_path=server.slot_save_path, swap=True
            ) as backend,
            ChatSession.open(
                db_url, conversation_id="a", backend=backend, system_prompt=SYSTEM,
                settings=GREEDY,
            ) as first_customer,
            ChatSession.open(
                db_url, conversation_id="b", backend=backend, system_prompt=SYSTEM,
                settings=GREEDY,
            ) as second_customer,
        ):  # fmt: skip
            first_customer.send("My order NH-4821 has not arrived yet.")
            second_customer.send("Hello, when do you open on Sundays?")
            (server.slot_save_path / swap_filename("a")).unlink()  # someone cleaned the folder
            again = first_customer.send("Could you check where it is?")
    finally:
        server.stop()
    assert again.turn is not None and again.text  # answered all the same
    assert again.turn.swap_in is None
    assert again.turn.reprefill_reason is not None
    assert again.turn.reprefill_reason.startswith("slot file not restored")


def test_swap_files_stay_within_swap_disk_mb(
    llama_server_binary: Path, smollm2_path: Path, tmp_path: Path, db_url: str
) -> None:
    # One conversation slot, three customers in turn, room for one slot file (each is about
    # 2 MB here): a new file deletes the one saved longest ago, and its customer prefills.
    server = start_server(llama_server_binary, smollm2_path, tmp_path / "server", slots=2)
    folder = server.slot_save_path
    assert folder is not None
    try:
        with LlamaServerBackend(
            server.url, model=smollm2_path, slot_save_path=folder, swap=True, swap_disk_mb=1
        ) as backend:
            chats = {
                cid: ChatSession.open(
                    db_url, conversation_id=cid, backend=backend, system_prompt=SYSTEM,
                    settings=GREEDY,
                )
                for cid in ("a", "b", "c")
            }  # fmt: skip
            try:
                for cid in ("a", "b", "c"):  # b saves a's file, c saves b's and deletes a's
                    chats[cid].send(f"Customer {cid} here: my parcel NH-4821 is late.")
                assert {p.name for p in folder.iterdir()} == {swap_filename("b")}
                back = chats["a"].send("Any news?")  # c's slot saved, b's file deleted
                assert {p.name for p in folder.iterdir()} == {swap_filename("c")}
            finally:
                for chat in chats.values():
                    chat.close()
    finally:
        server.stop()
    assert back.turn is not None and back.turn.swap_in is None
    assert back.turn.reprefill_reason == DROPPED


def test_swap_files_out_of_sight_are_left_with_a_warning(
    llama_server_binary: Path,
    smollm2_path: Path,
    tmp_path: Path,
    db_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The backend is told a folder that is not the one the server writes to (as for a server
    # on another machine): nothing can be deleted, so the files stay and a warning says so.
    server = start_server(llama_server_binary, smollm2_path, tmp_path / "server", slots=2)
    folder = server.slot_save_path
    assert folder is not None
    elsewhere = tmp_path / "not-the-servers"
    elsewhere.mkdir()
    caplog.set_level(logging.WARNING, logger="chatctx.backends.llama_server")
    try:
        with LlamaServerBackend(
            server.url, model=smollm2_path, slot_save_path=elsewhere, swap=True, swap_disk_mb=1
        ) as backend:
            for cid in ("a", "b", "c"):
                with ChatSession.open(
                    db_url, conversation_id=cid, backend=backend, system_prompt=SYSTEM,
                    settings=GREEDY,
                ) as chat:  # fmt: skip
                    chat.send(f"Customer {cid} here: my parcel NH-4821 is late.")
    finally:
        server.stop()
    assert {p.name for p in folder.iterdir()} == {swap_filename("a"), swap_filename("b")}
    assert "delete old chatctx-swap-*.bin files there" in caplog.text


def test_swap_needs_the_servers_slot_save_path() -> None:
    with pytest.raises(ConfigError, match="slot_save_path"):
        LlamaServerBackend("http://127.0.0.1:9", swap=True)
