import chatctx
import chatctx.backends.engine
import chatctx.store


def test_all_names_exist_and_are_unique() -> None:
    for module in (chatctx, chatctx.backends.engine, chatctx.store):
        assert len(set(module.__all__)) == len(module.__all__), module.__name__
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_error_tree() -> None:
    for name in (
        "ConfigError",
        "StoreError",
        "ModelError",
        "ContextBudgetError",
        "KVCacheError",
        "GenerationError",
        "ConversationNotFound",
        "ImportFormatError",
    ):
        assert issubclass(getattr(chatctx, name), chatctx.ChatctxError)
    assert issubclass(chatctx.ConversationNotFound, chatctx.StoreError)


def test_library_never_imports_click() -> None:
    import subprocess
    import sys

    code = (
        "import sys, chatctx, chatctx.session, chatctx.store, chatctx.backends.engine; "
        "print('click' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "False"


def test_what_chatsession_open_takes_is_importable_from_chatctx() -> None:
    import inspect

    from chatctx.session import ChatSession

    # Every parameter type of ChatSession.open that is chatctx's own is at the top level.
    hints = inspect.signature(ChatSession.open).parameters
    wanted = {"ContextSettings", "GenerationSettings", "Summarizer", "TextEmbedder", "Backend"}
    annotations = " ".join(str(p.annotation) for p in hints.values())
    for name in wanted:
        assert name in annotations, name  # the signature still names it
        assert name in chatctx.__all__ and hasattr(chatctx, name), name


def test_version_is_the_installed_distributions() -> None:
    from importlib import metadata

    assert chatctx.__version__ == metadata.version("chatctx")


def test_summary_error_is_in_the_error_tree() -> None:
    import chatctx.context
    import chatctx.errors

    assert chatctx.SummaryError is chatctx.errors.SummaryError is chatctx.context.SummaryError
    assert issubclass(chatctx.SummaryError, chatctx.ChatctxError)
