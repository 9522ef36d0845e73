from chatctx.context import ExtractiveSummarizer, LLMSummarizer
from chatctx.context._facts import fact_set
from chatctx.model.codec import TiktokenCodec
from chatctx.store import Message


def msgs(*pairs: tuple[str, str]) -> list[Message]:
    return [
        Message(id=i + 1, conversation_id="c", position=i, role=r, content=c)
        for i, (r, c) in enumerate(pairs)
    ]


CHAT = msgs(
    ("user", "Hi there!"),
    ("assistant", "Hello! How can I help?"),
    ("user", "My order NH-48213 never arrived. I'm Maria Lopez."),
    ("assistant", "Sorry Maria. I see order NH-48213 shipped on March 3 via DHL."),
    ("user", "The router model is AX3000 and it cost $199.99."),
    ("assistant", "Thanks. I opened ticket T-7781 for a replacement."),
)


def test_extractive_keeps_identifiers_and_is_deterministic(llama3_codec: TiktokenCodec) -> None:
    summarize = ExtractiveSummarizer(llama3_codec.count, max_tokens=80)
    first = summarize(None, CHAT)
    assert first == summarize(None, CHAT)
    for fact in ("NH-48213", "AX3000", "T-7781", "$199.99"):
        assert fact in first
    assert "Hi there" not in first
    assert llama3_codec.count(first) <= 80


def test_extractive_is_incremental_and_bounded(llama3_codec: TiktokenCodec) -> None:
    summarize = ExtractiveSummarizer(llama3_codec.count, max_tokens=48)
    summary = summarize(None, CHAT[:4])
    more = msgs(
        ("user", "Also my second order NH-50000 is late."),
        ("assistant", "Noted, NH-50000 ships tomorrow."),
    )
    updated = summarize(summary, more)
    assert "NH-50000" in updated
    assert llama3_codec.count(updated) <= 48


def test_llm_summarizer_folds_chunks() -> None:
    seen: list[str] = []

    def generate(messages: list[dict]) -> str:
        seen.append(messages[1]["content"])
        return f"summary v{len(seen)}"

    long_chat = msgs(*[("user", f"message {i} " + "word " * 50) for i in range(20)])
    summarizer = LLMSummarizer(
        generate, max_tokens=32, count=lambda t: len(t.split()), max_input_tokens=300
    )
    assert summarizer("old", long_chat) == f"summary v{len(seen)}"
    assert len(seen) > 1  # too long for one request: folded in chunks
    assert "Summary so far:\nold" in seen[0] and f"summary v{len(seen) - 1}" in seen[-1]


def test_facts_are_compared_as_a_set_not_by_substring(llama3_codec: TiktokenCodec) -> None:
    summarize = ExtractiveSummarizer(llama3_codec.count, max_tokens=96)
    first = summarize(None, msgs(("user", "My order is NH-48213.")))
    assert "NH-48213" in first
    # NH-4821 is a substring of NH-48213 but another order: it must be added.
    second = summarize(first, msgs(("user", "Oh, and there is NH-4821 too.")))
    assert second.startswith(first)
    assert "Facts: NH-4821" in second[len(first) :].splitlines()
    # The reverse: an identifier already in the summary (here only inside a kept sentence)
    # is not added again.
    previous = "User: my ticket T-7781 is still open"
    assert summarize(previous, msgs(("assistant", "Ticket T-7781 is with the team."))) == previous


def test_appending_keeps_the_previous_summary_as_a_token_prefix(
    llama3_codec: TiktokenCodec,
) -> None:
    summarize = ExtractiveSummarizer(llama3_codec.count, max_tokens=160)
    summary = summarize(None, CHAT[:4])
    for said in ("oh and im allergic to shellfish", "lol ok", "my dog is called biscuit"):
        updated = summarize(summary, msgs(("user", said), ("assistant", "Noted!")))
        assert updated.startswith(summary)
        old, new = llama3_codec.encode(summary), llama3_codec.encode(updated)
        assert new[: len(old)] == old  # llama.cpp reuses every cached token of the summary
        summary = updated
    assert "shellfish" in summary and "biscuit" in summary


def test_nothing_new_returns_the_previous_summary_unchanged(llama3_codec: TiktokenCodec) -> None:
    summarize = ExtractiveSummarizer(llama3_codec.count, max_tokens=80)
    first = summarize(None, CHAT)
    assert summarize(first, CHAT) == first  # the same facts again: nothing to add
    assert summarize(first, msgs(("user", "haha thanks"), ("assistant", "Anytime!"))) == first
    assert summarize(None, msgs(("user", "hi"), ("assistant", "Hello!"))) == ""


def test_identifiers_and_values_are_found_inside_text_without_spaces() -> None:
    from chatctx.context._facts import identifiers, values

    # Hand-read: an identifier between letters of a sentence written without spaces, and
    # values written alike in any language (a time, a grouped amount, a number and its unit);
    # five digits or more make a value an identifier.
    assert identifiers("我上周抢的票，订单号是DM7720135946一共三张。") == ["DM7720135946"]
    text = "제 번호는A-4821이고 환불 금액은 38,000원, 3박 일정입니다"
    assert (identifiers(text), values(text)) == (["A-4821", "38,000원"], ["3박"])
    assert values("予約は3月14日の14時です") == ["3月", "14日", "14時"]
    # The longest of overlapping matches: a phone number, not its groups; a model whose
    # letters run on after the dash.
    assert identifiers("連絡は090-4418-2275、機種はEW-M873Tです") == ["090-4418-2275", "EW-M873T"]
    text = "ticket T-7781, $49 at 14:30 on 3/14; 2 cats"
    assert (identifiers(text), values(text)) == (["T-7781", "$49"], ["14:30", "3/14"])
    # An account name of lowercase letters on a long number, between letters of a sentence
    # without spaces; a size written with an x or a times sign, in any language; an amount
    # with its currency sign after it, as much an amount as "$49".
    assert identifiers("给您开通的宽带账号是sz31884206，初始密码") == ["sz31884206"]
    # Digits start no account name: a date cut short keeps no hyphen of its cut.
    assert identifiers("firmware 2.1.4, 2022-01-") == ["2022-01"]
    assert values("el trastero de 5x10 o uno de 3 × 4") == ["5x10", "3 × 4"]
    assert identifiers("un suplemento de 6,50 € por noche") == ["6,50 €"]
    # Names set off by quotation marks in any script, and capitalized ones, outside English
    # (English chat quotes words in passing; its names come from its own rules).
    quoted = "「らくらくパック」と“居民峰谷分时电价”"
    assert identifiers(quoted) == ["らくらくパック", "居民峰谷分时电价"]
    assert identifiers("El técnico es Ramiro Esquivel, llega el martes.") == ["Ramiro Esquivel"]
    assert identifiers("I don't think the kids' toys fit, said Anna 'busy' Smith.") == []


def test_extractive_keeps_what_the_agent_states_in_korean(llama3_codec: TiktokenCodec) -> None:
    chat = msgs(
        ("user", "안녕하세요, 인터넷이 자꾸 끊겨요."),
        ("assistant", "접수번호는 TK-58210입니다. 기사님이 목요일 오후 2시에 방문합니다."),
        ("user", "네 감사합니다. 그럼 그때 뵐게요!"),
        ("assistant", "네, 좋은 하루 되세요."),
    )
    summary = ExtractiveSummarizer(llama3_codec.count, max_tokens=120)(None, chat)
    assert "TK-58210" in summary and "오후 2시" in summary  # the agent's ticket and time
    assert "좋은 하루" not in summary


def test_a_value_said_anew_is_found_by_its_shape_and_the_words_next_to_it() -> None:
    from chatctx.context._facts import identifiers, replaced

    # Hand-read pairs: the same kind of value (digits aside, written alike) after a word the
    # two sentences share in the value's clause, in four languages.
    assert replaced("정기 점검은 매주 3일에 해요", "이제 정기 점검은 매주 9일로 바뀌었어요") == [
        ("3일", "9일")
    ]
    assert replaced("受付は午前10時からです。", "明日の受付は午前11時に変わります。") == [
        ("10時", "11時")
    ]
    # Two values of one shape: the new one replaces the one named by the same word.
    assert replaced("工厂早上8点开门，仓库下午6点关门", "通知：仓库改为下午7点关门") == [
        ("6点", "7点")
    ]
    assert replaced("La clase es a las 18:30 en la sala", "Ojo: la clase pasa a las 19:15") == [
        ("18:30", "19:15")
    ]
    # Not a change: the same value again, another kind of value, or another word right
    # before the value (opening and closing; two fruits; a night bus and a morning return).
    assert replaced("Pickup at 8:30 at the gym", "Yes, pickup at 8:30 at the gym") == []
    assert replaced("Pickup at 8:30 at the gym", "Pickup on 8/30 at the gym") == []
    assert replaced("The store opens at 9:00 daily", "The store closes at 21:00 daily") == []
    assert replaced("사과 3개 주세요", "배 5개 주세요") == []
    assert replaced("셔틀은 밤 10시까지 운행해요", "반납은 오전 11시까지 해 주세요") == []
    # An address ends where Latin letters end, a long number where its digits do; an
    # identifier keeps its last character.
    assert identifiers("새 주소는mina.k@example.com으로 해 주세요") == ["mina.k@example.com"]
    # An address whose name holds a long number or capitals is one address.
    assert identifiers("mail kim0815@mail.example or JOE2024@x.org") == [
        "kim0815@mail.example",
        "JOE2024@x.org",
    ]
    assert identifiers("换成15908632217了，谢谢") == ["15908632217"]
    text = "order A12345, ticket #12345, $12345, call 555-1234"
    assert identifiers(text) == ["A12345", "#12345", "$12345", "555-1234"]


def test_the_summary_keeps_a_changed_value_after_the_old_one(
    llama3_codec: TiktokenCodec,
) -> None:
    filler = [
        ("user", "네 알겠습니다. 그런데 혹시 주말에도 상담 가능한가요?"),
        ("assistant", "네, 주말에는 오전에만 채팅 상담이 가능합니다. 편하실 때 문의 주세요."),
    ] * 3
    chat = msgs(
        ("user", "정기 배송은 매달 5일에 받고 있어요. 회원번호는 MB-20417이에요."),
        ("assistant", "확인했습니다. 다음 배송도 매달 5일에 출발합니다."),
        *filler,
        ("user", "아 그리고 정기 배송은 이제 매달 25일로 바꿔 주세요."),
        ("assistant", "네, 변경해 두었습니다."),
    )
    summarize = ExtractiveSummarizer(llama3_codec.count, max_tokens=90)
    summary = None
    for message in chat:  # one message at a time, as the builder evicts them
        summary = summarize(summary, [message])
    assert summary is not None
    # The new value is kept, though the summary is full of older items, after the old one.
    assert "5일에" in summary and "25일" in summary
    assert summary.rfind("5일에") < summary.find("25일")


def test_a_full_summary_is_rewritten_for_a_new_value_of_one_it_holds(
    llama3_codec: TiktokenCodec,
) -> None:
    summarize = ExtractiveSummarizer(llama3_codec.count, max_tokens=80)
    previous = None
    for message in msgs(
        ("user", "정기 배송은 매달 5일에 받고 있어요."),
        (
            "assistant",
            "회원번호 MB-20417로 조회됩니다. 주문번호는 OR-55102이고 상품은 AX3000입니다.",
        ),
        (
            "assistant",
            "상담 접수번호는 CS-24-0871이고 담당자는 KM-1027입니다. 계좌는 T-7781로 등록했어요.",
        ),
    ):
        previous = summarize(previous, [message])
    assert previous is not None and "5일" in previous
    assert llama3_codec.count(previous) > 80 - 10  # full: no new sentence fits after it
    change = msgs(("user", "아 그리고 정기 배송은 이제 매달 25일로 바꿔 주세요."))
    other = msgs(("user", "주말 배송은 오후 3시쯤 받으면 좋겠어요."))
    # A value said anew for one the summary holds: without it the summary would hold the
    # old day alone, so it is rewritten, and the new day kept (all identifiers with it).
    renewed = summarize(previous, change)
    assert "25일" in renewed and llama3_codec.count(renewed) <= 80
    assert all(i in renewed for i in ("MB-20417", "OR-55102", "CS-24-0871", "T-7781"))
    # A value the summary holds nothing of is no reason to rewrite it (its cached tokens stay).
    assert summarize(previous, other) == previous


def test_a_new_value_the_summary_holds_already_forces_no_rewrite(
    llama3_codec: TiktokenCodec,
) -> None:
    previous = (
        "User: 정기 배송은 매달 5일에 받고 있어요\n"
        "Facts: MB-20417; OR-55102\n"
        "Assistant: 회원번호 MB-20417로 조회됩니다; 주문번호는 OR-55102입니다\n"
        "User: 아 그리고 정기 배송은 이제 매달 25일로 바꿔 주세요"
    )
    summarize = ExtractiveSummarizer(
        llama3_codec.count, max_tokens=llama3_codec.count(previous) + 3
    )
    # The agent confirming the new day: against the old item it reads as a change, but the
    # summary holds 25일 already, so there is nothing to rewrite for (its tokens stay cached).
    confirm = msgs(("assistant", "네, 정기 배송은 매달 25일로 변경되었습니다."))
    assert summarize(previous, confirm) == previous
    # The same summary without the new day is rewritten for it.
    old_only = previous.rsplit("\n", 1)[0]
    renewed = ExtractiveSummarizer(llama3_codec.count, max_tokens=llama3_codec.count(old_only) + 3)(
        old_only, confirm
    )
    assert "25일" in renewed


def test_sentences_end_at_the_question_marks_of_other_scripts() -> None:
    """An Arabic question mark ends a sentence as "?" does; Chinese and Japanese end one
    without a space; an abbreviation's full stop ends none (split by hand)."""
    from chatctx.context._facts import sentences

    assert sentences("هل وصل الطلب؟ نعم، وصل أمس.") == ["هل وصل الطلب؟", "نعم، وصل أمس."]
    assert sentences("订单到了吗？到了。") == ["订单到了吗？", "到了。"]
    assert sentences("¿Llegó el pedido? Sí, con el Dr. Ruiz.") == [
        "¿Llegó el pedido?",
        "Sí, con el Dr. Ruiz.",
    ]


def test_a_long_sentence_without_spaces_is_kept_by_the_clauses_that_hold_its_values(
    llama3_codec: TiktokenCodec,
) -> None:
    chat = msgs(
        ("user", "退货的钱什么时候退回来？"),
        ("assistant", "退款会在审核通过后处理，预计金额为328元，请您耐心等待，有问题随时联系。"),
        ("assistant", "配送業者が確認いたしまして、お届けは明日の午後3時、置き配も可能です。"),
        (
            "assistant",
            "La recogida será a las 10:30, el repartidor llamará antes; el coste es de 6,50 €.",
        ),
    )
    summary = ExtractiveSummarizer(llama3_codec.count, max_tokens=200)(None, chat)
    # Hand-read: in Chinese and Japanese the clauses with a value stay, and the advice
    # around them goes; a sentence in a spaced script is cut by its word count only, so the
    # Spanish one stays whole, and its amount keeps its currency sign.
    assert (
        "Assistant: 预计金额为328元; お届けは明日の午後3時; La recogida será a las 10:30, "
        "el repartidor llamará antes, el coste es de 6,50 €"
    ) in summary
    for advice in ("审核通过", "耐心等待", "配送業者", "置き配"):
        assert advice not in summary


def test_a_long_run_of_digits_or_values_is_read_in_one_pass() -> None:
    import subprocess
    import sys

    # A pasted log or a tool's result can hold a long run of digits. A value pattern tried
    # at every digit of it rescans the rest of the run each time: 20,000 digits took 50 s.
    # Read from the run's first digit only, 200,000 take milliseconds; the limit below is a
    # thousand times that, so only a scan that goes back over the run fails it. Likewise
    # values given anew are looked up by kind, not compared each with each.
    code = (
        "from chatctx.context._facts import identifiers, values\n"
        "run = '7' * 200_000\n"
        "assert identifiers(run + '원') == [run], 'a long number'\n"
        "assert values(run + ' 11시') == ['11시'], 'a value after it'\n"
        "assert identifiers('1' * 100_000 + ':30') == ['1' * 100_000 + ':30'], 'a time'\n"
        # 40,000 values against 40,000 (compared each with each: 20,000 took 109 s, this 4x):
        # the old value once, replaced by the new one once.
        "from chatctx.context._facts import replaced\n"
        "assert replaced('가1' * 40_000, '가2' * 40_000) == [('1가', '2가')], 'replaced'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_a_rewrite_drops_the_old_value_before_the_new(llama3_codec: TiktokenCodec) -> None:
    count = llama3_codec.count
    previous = (
        "User: 사료는 매달 7일에 2kg씩 받고 있어요\n"
        "Facts: MB-20417\n"
        "Assistant: 회원번호 MB-20417로 조회됩니다\n"
        "User: 아 그리고 제 월급날이 바뀌어서요 앞으로는 매달 22일에 받는 걸로 변경 부탁드려요"
    )
    news = msgs(("user", "주문번호는 OR-55102이고 쿠폰은 CP-3391이에요."))
    # Two new identifiers force a rewrite with room for one of the two days: the later one
    # stays (it gives the delivery day anew), the earlier goes, every identifier stays.
    rewritten = ExtractiveSummarizer(count, max_tokens=count(previous) + 9)(previous, news)
    assert "매달 22일" in rewritten and "매달 7일" not in rewritten
    assert {"MB-20417", "OR-55102", "CP-3391"} <= fact_set(rewritten)
