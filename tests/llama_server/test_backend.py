"""LlamaServerBackend against a real llama-server: setup checks, errors, slots, states."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from chatctx import BackendUnavailable, ConfigError, ContextBudgetError
from chatctx.backends.base import Backend
from chatctx.backends.llama_server import LlamaServerBackend, LlamaServerProcess, free_port
from chatctx.errors import GenerationError
from chatctx.settings import GenerationSettings
from tests.llama_server.conftest import N_CTX, SLOTS, start_server
from tests.llama_server.test_router_servers import metrics

pytestmark = pytest.mark.slow

GREEDY = GenerationSettings(max_tokens=8, temperature=0.0, repeat_penalty=1.0)


def props(server: LlamaServerProcess) -> dict[str, object]:
    body: dict[str, object] = httpx.get(f"{server.url}/props", timeout=30).json()
    return body


def test_it_reads_the_servers_layout(
    backend: LlamaServerBackend, server: LlamaServerProcess
) -> None:
    assert isinstance(backend, Backend)
    served = props(server)
    assert served["total_slots"] == SLOTS
    assert backend.n_ctx == N_CTX  # what -c/-np gave each slot
    assert backend.slots == SLOTS - 1 and backend.summary_seq == SLOTS - 1
    assert backend.side_room == N_CTX
    assert backend.name == server.url
    info = backend.info()
    assert info.n_ctx == N_CTX and info.slots == SLOTS - 1 and info.n_seq_max == SLOTS
    assert info.extra["build_info"] == served["build_info"]
    assert info.architecture == "llama"
    backend.health()


def test_a_mismatch_is_refused(
    server: LlamaServerProcess, smollm2_path: Path, tiny_llama3_path: Path
) -> None:
    with pytest.raises(ConfigError, match=rf"holds {N_CTX} tokens per slot, not n_ctx=4096"):
        LlamaServerBackend(server.url, model=smollm2_path, n_ctx=4096)
    # Another model's vocabulary (Llama 3's) tokenizes the probes differently.
    with pytest.raises(ConfigError, match="tokenizes differently"):
        LlamaServerBackend(server.url, model=tiny_llama3_path)
    with pytest.raises(ConfigError, match="one URL"):
        LlamaServerBackend([server.url], model=smollm2_path)  # type: ignore[arg-type]


def test_too_few_slots_are_refused(
    llama_server_binary: Path, smollm2_path: Path, tmp_path: Path
) -> None:
    from tests.llama_server.conftest import start_server

    with start_server(llama_server_binary, smollm2_path, tmp_path, slots=1, n_ctx=256) as one:
        with pytest.raises(ConfigError, match="has 1 slot"):
            LlamaServerBackend(one.url, model=smollm2_path)
        with LlamaServerBackend(one.url, model=smollm2_path, summary_slot=False) as alone:
            assert alone.slots == 1 and alone.side_room == 0


def test_connection_refused(smollm2_path: Path) -> None:
    port = free_port()  # nobody listens there
    with pytest.raises(BackendUnavailable) as caught:
        LlamaServerBackend(f"http://127.0.0.1:{port}", model=smollm2_path)
    assert caught.value.reason == "refused"
    assert caught.value.backend == f"http://127.0.0.1:{port}"
    with pytest.raises(BackendUnavailable) as waited:
        LlamaServerBackend(f"http://127.0.0.1:{port}", model=smollm2_path, wait_ready=0.5)
    assert waited.value.reason == "refused"


def test_a_prompt_over_the_slot_is_a_budget_error(
    backend: LlamaServerBackend, server: LlamaServerProcess
) -> None:
    words = backend.tokenize(" order" * N_CTX, special=False)[:N_CTX]
    prompt = [*backend.tokenize("<|im_start|>user\n", special=True), *words]
    # The oracle: the server itself refuses this prompt.
    direct = httpx.post(
        f"{server.url}/completion", json={"prompt": prompt, "n_predict": 1}, timeout=60
    )
    assert direct.status_code == 400
    assert direct.json()["error"]["type"] == "exceed_context_size_error"
    with pytest.raises(ContextBudgetError) as caught:
        backend.generate(prompt, seq_id=0, settings=GREEDY).wait()
    assert caught.value.n_ctx == N_CTX
    assert caught.value.prompt_tokens == len(prompt)


def test_bad_input_is_refused(backend: LlamaServerBackend) -> None:
    with pytest.raises(ConfigError, match="not a conversation slot"):
        backend.generate([1, 2, 3], seq_id=SLOTS - 1)  # the summary slot
    with pytest.raises(ConfigError, match="eviction"):
        backend.generate([1, 2, 3], seq_id=0, eviction="sideways")
    with pytest.raises(GenerationError, match="empty"):
        backend.generate([], seq_id=0)


def test_a_generation_dropped_unread_does_not_hold_its_slot(backend: LlamaServerBackend) -> None:
    lease = backend.lease("dropped")
    try:
        running = backend.generate([1, 2, 3], seq_id=lease.seq_id, settings=GREEDY)
        with pytest.raises(ConfigError, match="in use by a running generation"):
            backend.clear(lease.seq_id)  # the oracle that the check sees a live generation
        del running  # never iterated, never closed: it never ran, and nothing holds it
        gc.collect()
        backend.clear(lease.seq_id)
    finally:
        backend.release(lease)


def test_figures_come_from_the_server(
    backend: LlamaServerBackend, server: LlamaServerProcess
) -> None:
    prompt = backend.prompt_tokens([{"role": "user", "content": "Name three colours."}])
    lease = backend.lease("figures")
    try:
        first = backend.generate(prompt, seq_id=lease.seq_id, settings=GREEDY).wait()
        again = backend.generate(prompt, seq_id=lease.seq_id, settings=GREEDY).wait()
    finally:
        backend.release(lease)
    assert first.slot == lease.seq_id and again.slot == lease.seq_id
    assert first.usage.prompt_tokens == len(prompt)
    assert first.usage.generated_tokens == len(first.tokens) > 0
    assert first.kv is not None and first.kv.policy == "server"
    # The same prompt again: all of it is cached but the last token (its logits are needed).
    assert again.usage.reused_tokens == len(prompt) - 1
    assert again.usage.evaluated_tokens == 1
    assert again.text == first.text and again.tokens == first.tokens
    assert first.stop_reason in ("eog", "length")
    # /slots (the oracle) shows the slot's cache.
    slot = next(
        s for s in httpx.get(f"{server.url}/slots", timeout=30).json() if s["id"] == lease.seq_id
    )
    assert backend.kv_usage()[lease.seq_id] == slot["n_prompt_tokens"] > len(prompt) - 1
    # What chatctx knows the slot holds, with no request: the same.
    assert backend.kv_usage(known=True)[lease.seq_id] == slot["n_prompt_tokens"]
    # It holds the prompt and the reply, less the last token sampled unless that was the
    # end of generation (not counted as a reply token, never evaluated).
    held = len(prompt) + len(again.tokens) - (0 if again.stop_reason == "eog" else 1)
    assert slot["n_prompt_tokens"] == held


def test_export_import_and_forget(backend: LlamaServerBackend, server: LlamaServerProcess) -> None:
    prompt = backend.prompt_tokens([{"role": "user", "content": "Say hello to Bob."}])
    lease = backend.lease("saved")
    try:
        backend.generate(prompt, seq_id=lease.seq_id, settings=GREEDY).wait()
    finally:
        backend.release(lease)
    filename = backend.export_state("saved")
    assert filename is not None
    assert server.slot_save_path is not None
    assert (server.slot_save_path / filename).stat().st_size > 0
    assert backend.export_state("never-seen") is None
    backend.forget("saved")
    assert backend.slot_of("saved") is None
    slots = {s["id"]: s for s in httpx.get(f"{server.url}/slots", timeout=30).json()}
    assert slots[lease.seq_id]["n_prompt_tokens"] == 0  # erased on the server
    assert backend.import_state("saved", filename)
    seq = backend.slot_of("saved")
    assert seq is not None
    slots = {s["id"]: s for s in httpx.get(f"{server.url}/slots", timeout=30).json()}
    assert slots[seq]["n_prompt_tokens"] >= len(prompt)
    # The restored cache is used: the next turn re-evaluates only the last prompt token.
    lease = backend.lease("saved")
    try:
        result = backend.generate(prompt, seq_id=lease.seq_id, settings=GREEDY).wait()
    finally:
        backend.release(lease)
    assert result.usage.reused_tokens == len(prompt) - 1
    # A file the server does not have restores nothing.
    assert not backend.import_state("saved-missing", "chatctx-no-such-file.bin")


def test_a_conversation_over_the_slots_takes_the_least_recently_used(
    backend: LlamaServerBackend,
) -> None:
    prompt = backend.prompt_tokens([{"role": "user", "content": "Count to three."}])
    owners = [f"lru-{i}" for i in range(backend.slots)]
    for owner in owners:
        lease = backend.lease(owner)
        backend.generate(prompt, seq_id=lease.seq_id, settings=GREEDY).wait()
        backend.release(lease)
        time.sleep(0.01)
    oldest = backend.slot_of(owners[0])
    newcomer = backend.lease("lru-new")
    backend.release(newcomer)
    assert newcomer.seq_id == oldest and newcomer.reprefill_reason is None
    back = backend.lease(owners[0])  # lost its slot: it says so
    backend.release(back)
    assert back.reprefill_reason is not None and "another conversation" in back.reprefill_reason
    assert back.backend == backend.name


def test_side_generation_runs_on_the_summary_slot(
    backend: LlamaServerBackend, server: LlamaServerProcess
) -> None:
    prompt = backend.prompt_tokens(
        [{"role": "user", "content": "Summarize: the router was replaced."}]
    )
    text = backend.side_generate(prompt, settings=GREEDY)
    assert text
    slots = {s["id"]: s for s in httpx.get(f"{server.url}/slots", timeout=30).json()}
    assert slots[SLOTS - 1]["n_prompt_tokens"] >= len(prompt)
    cancel = threading.Event()
    backend.cancel_side(cancel)
    with pytest.raises(GenerationError, match="cancelled"):
        backend.side_generate(prompt, settings=GREEDY, cancel=cancel)


def test_wait_ready_waits_for_a_server_still_starting(
    llama_server_binary: Path, smollm2_path: Path, tmp_path: Path
) -> None:
    from tests.llama_server.conftest import SERVER_ARGS

    starting = LlamaServerProcess(
        smollm2_path, slots=2, n_ctx=256, binary=llama_server_binary, extra_args=SERVER_ARGS
    )
    # Started without waiting: the backend sees refused connections, then 503 while the
    # model loads, then a healthy server.
    starting.start(wait=False)
    try:
        with LlamaServerBackend(starting.url, model=smollm2_path, wait_ready=120) as backend:
            backend.health()
            assert backend.n_ctx == 256
    finally:
        starting.stop()


def test_a_silent_server_is_a_timeout(
    backend: LlamaServerBackend, server: LlamaServerProcess
) -> None:
    # A prompt whose prefill outlasts the read timeout: nothing arrives in time.
    text = " ".join(f"line {i} of a long log" for i in range(120))
    with LlamaServerBackend(
        server.url, model=backend.model_path, timeout=0.3, slot_save_path=server.slot_save_path
    ) as impatient:
        prompt = impatient.prompt_tokens([{"role": "user", "content": text}])
        lease = impatient.lease("impatient")
        try:
            impatient.clear(lease.seq_id)
            with pytest.raises(BackendUnavailable) as caught:
                impatient.generate(prompt, seq_id=lease.seq_id, settings=GREEDY).wait()
        finally:
            impatient.release(lease)
    assert caught.value.reason == "timeout"


def test_a_server_loading_its_model_is_unavailable_loading(
    llama_server_binary: Path, smollm2_path: Path, tmp_path: Path
) -> None:
    # The model is a named pipe nobody writes yet: the server answers HTTP but stays in
    # "Loading model" (503) for as long as the test wants, which a real model loads too fast
    # to show. The backend says so, at start and in health checks, as BackendUnavailable
    # with reason "loading"; once the load fails the server is gone: "refused".
    pipe = tmp_path / "model.gguf"
    os.mkfifo(pipe)
    loading = LlamaServerProcess(
        pipe, slots=2, n_ctx=256, binary=llama_server_binary, extra_args=("--load-mode", "none")
    )
    loading.start(wait=False)
    try:
        deadline = time.monotonic() + 60
        while True:  # the port opens after a moment
            try:
                httpx.get(f"{loading.url}/health", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "llama-server never listened"
                time.sleep(0.1)
        with pytest.raises(BackendUnavailable) as caught:
            LlamaServerBackend(loading.url, model=smollm2_path)
        assert caught.value.reason == "loading"
        assert "503" in str(caught.value) or "load" in str(caught.value).lower()
        # A pipe is no file to load from (llama.cpp seeks): it gives up once fed the model.
        assert loading.process is not None
        data = smollm2_path.read_bytes()
        while loading.process.poll() is None:
            assert time.monotonic() < deadline + 60, "llama-server kept loading"
            try:  # whenever the server has the pipe open for reading
                fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                time.sleep(0.05)
                continue
            with contextlib.suppress(OSError), os.fdopen(fd, "wb") as writer:
                writer.write(data)
        with pytest.raises(BackendUnavailable) as gone:
            LlamaServerBackend(loading.url, model=smollm2_path)
        assert gone.value.reason == "refused"
    finally:
        loading.stop()


@pytest.mark.parametrize("ram_cache", [True, False])
def test_an_edited_prompt_of_a_conversation_that_lost_its_slot_comes_back_from_the_ram_cache(
    llama_server_binary: Path, smollm2_path: Path, tmp_path: Path, ram_cache: bool
) -> None:
    # One slot, no swap files: customer A loses the slot to B, then comes back with turns
    # deleted from the front of its history (an eviction), twice. The server's host-RAM
    # prompt cache keeps A's prompt but looks it up by its beginning only; asked for A's last
    # prompt first, it gives it back and its cache-reuse walk keeps what follows the deletion.
    # The oracle: the prompt tokens the server counts (/metrics), and the same turns on a
    # server without that cache (--cache-ram 0): there the last prompt, asked for once, is
    # evaluated, and then never asked for again.
    extra = () if ram_cache else ("--cache-ram", "0")
    server = start_server(llama_server_binary, smollm2_path, tmp_path, slots=1, extra=extra)
    first = {"role": "user", "content": "My parcel has not arrived."}
    middle = {"role": "user", "content": "It is order A-1177. " + "It was a gift. " * 40}
    last = {"role": "user", "content": "The courier said Tuesday. " + "I waited at home. " * 40}
    other = [{"role": "user", "content": "What are your opening hours?"}]
    answer = {"role": "assistant", "content": "I am looking into it."}
    prompts = [
        [first, answer, middle, answer, last, answer],
        [middle, answer, last, answer, {"role": "user", "content": "Any news?"}],
        [last, answer, {"role": "user", "content": "Still nothing?"}],
    ]
    spent: list[tuple[int, int, int]] = []  # (prompt length, server counted, turn record)
    try:
        with LlamaServerBackend(server.url, model=smollm2_path, summary_slot=False) as backend:
            for owner, messages in (("A", prompts[0]), ("B", other)):
                lease = backend.lease(owner)
                backend.generate(
                    backend.prompt_tokens(messages), seq_id=lease.seq_id, settings=GREEDY
                ).wait()
                backend.release(lease)
            for messages in prompts[1:]:
                tokens = backend.prompt_tokens(messages)
                before = metrics(server.url)["prompt_tokens_total"]
                lease = backend.lease("A")
                try:
                    back = backend.generate(tokens, seq_id=lease.seq_id, settings=GREEDY).wait()
                finally:
                    backend.release(lease)
                counted = metrics(server.url)["prompt_tokens_total"] - before
                spent.append((len(tokens), int(counted), back.usage.evaluated_tokens))
                lease = backend.lease("B")  # B takes the slot again
                backend.generate(
                    backend.prompt_tokens(other), seq_id=lease.seq_id, settings=GREEDY
                ).wait()
                backend.release(lease)
            length0 = len(backend.prompt_tokens(prompts[0]))
    finally:
        server.stop()
    for _, counted, recorded in spent:
        assert recorded == counted  # a turn's record counts what bringing it back cost
    (edit1, counted1, _), (edit2, counted2, _) = spent
    if ram_cache:  # the kept turns (most of each prompt) came back, moved over the deletion
        assert counted1 < edit1 // 3 and counted2 < edit2 // 3
    else:  # the last prompt was asked for once and evaluated; the next edit was sent as is
        assert counted1 > length0 // 2
        assert edit2 // 2 < counted2 <= edit2
