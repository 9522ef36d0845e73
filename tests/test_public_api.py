import chatctx
import chatctx.engine
import chatctx.store


def test_all_names_exist_and_are_unique() -> None:
    for module in (chatctx, chatctx.engine, chatctx.store):
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
        "import sys, chatctx, chatctx.session, chatctx.store, chatctx.engine; "
        "print('click' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "False"
