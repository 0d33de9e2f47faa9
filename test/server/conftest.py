"""Fixtures shared by the endpoint tests that run the real FastAPI app over scripted model output."""

import pytest
from fastapi.testclient import TestClient

from sglang.srt.entrypoints.http_server import create_app
from sglang.srt.server_args import ServerArgs


@pytest.fixture()
def app():
    """(tm, client): the app over test_chat_glue's ScriptedTokenizerManager, with the DeepSeek-V4 reasoning and
    tool-call parsers (tm.script is what the model writes)."""
    from test_chat_glue import ScriptedTokenizerManager

    tm = ScriptedTokenizerManager()
    args = ServerArgs(model_path="scripted", reasoning_parser="deepseek-v4", tool_call_parser="deepseekv4")
    with TestClient(create_app(tm, args)) as client:
        yield tm, client
