"""`npustudio serve`: the OpenAI-compatible endpoint (`core/serve.py`) over the runner `chat` would use."""

from __future__ import annotations

import argparse
import os

from rich.markup import escape

from ..core.errors import UserError
from .console import err, live_state
from .genie import runner_of

KEY_ENV = "NPUSTUDIO_API_KEY"


def cmd_serve(a: argparse.Namespace) -> int:
    import asyncio

    from ..core import serve

    key = os.environ.get(KEY_ENV) or None
    serve.check_address(a.host, key)
    bundle, where, lora = runner_of(a)
    with live_state() as st:  # a device gets the bundle first (nothing moves when it is there already)
        server = serve.open_server(bundle, where, a.device, st, api_key=key, max_waiting=a.max_waiting, lora=lora)
    model_id, engine = server.model_id, server.engine

    def ready(url: str) -> None:
        auth = f'api_key=os.environ["{KEY_ENV}"]' if key else 'api_key="none"'
        err.print(f"serving {escape(model_id)!r} ({escape(engine.name)}) at {url}  — Ctrl-C stops\n"
                  f"  from openai import OpenAI\n"
                  f"  client = OpenAI(base_url={url!r}, {auth})\n"
                  f"  client.chat.completions.create(model={model_id!r}, messages=[{{\"role\": \"user\", "
                  f"\"content\": \"Hello\"}}], stream=True)", highlight=False)

    try:
        asyncio.run(serve.serve(server, a.host, a.port, ready))
    except OSError as e:
        raise UserError(f"Cannot listen on {a.host}:{a.port}: {e.strerror or e}.",
                        "Pick another --port (0: any free one), or stop what uses that one.") from e
    except KeyboardInterrupt:
        err.print("server stopped")
        return 130
    return 0
