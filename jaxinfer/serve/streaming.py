"""Server-sent events: a request's RequestOutputs as OpenAI stream chunks.

Deltas holds back a tail of text that may still begin a stop string, so the deltas add up to
the final text; its StopMatcher sees only new text, so a stream costs time linear in its length.
SSEResponse calls on_close exactly once however the stream ends.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable, Optional

from starlette.responses import Response

from jaxinfer import openai_api as oa
from jaxinfer.engine.textstream import StopMatcher


class SequenceView:
    """Sequence `index` of a RequestOutput, with the fields Deltas reads (n > 1)."""

    def __init__(self, out, index: int):
        seq = out.outputs[index] if out.outputs else out
        self.text, self.token_ids, self.logprobs = seq.text, seq.token_ids, seq.logprobs
        self.finish_reason = seq.finish_reason
        self.finished = seq.finish_reason is not None
        self.prompt, self.prompt_token_ids = out.prompt, out.prompt_token_ids
        self.prompt_logprobs = out.prompt_logprobs
        self.request = out


class Deltas:
    """Chunks for one choice (`index`) of a stream, from successive RequestOutputs (or their
    SequenceViews)."""

    def __init__(self, req: oa.ParsedRequest, tokenizer, *, response_id: str, created: int,
                 model: str, index: int = 0, formats: Optional[oa.ChatFormats] = None):
        self.req, self.tok, self.index = req, tokenizer, index
        self.formats = formats or oa.ChatFormats()
        self.chat = None  # oa.ChatStream, made at the first output (it needs the prompt)
        self.kw = dict(response_id=response_id, created=created, model=model, index=index)
        stops = req.params.stop_strings
        self.matcher = StopMatcher(stops) if stops else None
        self.chars = 0         # characters of text sent
        self.tokens = 0        # tokens whose logprobs were sent
        self.lp_offset = 0     # completions text_offset of the next token
        self.started = False
        self.last = None       # the latest RequestOutput

    def first(self) -> list[dict]:
        """Chunks before any token: the chat role."""
        if self.req.endpoint == oa.CHAT:
            return [oa.stream_chunk(self.req, role=True, **self.kw)]
        return []

    def _logprobs(self, out, upto: int) -> Optional[dict]:
        if self.req.logprobs is None or upto <= self.tokens:
            return None
        ids, lps = out.token_ids[self.tokens:upto], (out.logprobs or [])[self.tokens:upto]
        if self.req.endpoint == oa.CHAT:
            return oa.chat_logprobs(self.tok, ids, lps, self.req.logprobs)
        lp = oa.completion_logprobs(self.tok, ids, lps, self.req.logprobs, self.lp_offset)
        self.lp_offset += sum(len(t) for t in lp["tokens"])
        return lp

    def _echo(self, out) -> Optional[dict]:
        """Completions with echo: the prompt (and its logprobs) as the first text chunk."""
        text = out.prompt if out.prompt is not None else self.tok.decode(out.prompt_token_ids)
        lp = None
        if self.req.logprobs is not None:
            lps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))
            lp = oa.completion_logprobs(self.tok, out.prompt_token_ids, lps, self.req.logprobs)
            self.lp_offset = sum(len(t) for t in lp["tokens"])
        return oa.stream_chunk(self.req, text=text, logprobs=lp, **self.kw)

    def _final_end(self, out) -> int:
        """How much of out.text is final: all of it once finished, else all but the longest
        tail that may still begin a stop string."""
        if out.finished or self.matcher is None:
            return len(out.text)
        self.matcher.feed(out.text[self.matcher.fed:])
        return len(out.text) - self.matcher.held

    def update(self, out) -> list[dict]:
        """Chunks for what `out` adds: new final text (and the logprobs of the tokens so
        far), and the finish_reason with the last one."""
        self.last = out
        chunks = []
        if self.req.echo and not self.started:
            chunks.append(self._echo(out))
        self.started = True
        end = self._final_end(out)
        upto = len(out.token_ids)
        if end > self.chars or upto > self.tokens or out.finished:
            text = out.text[self.chars:end]
            lp = self._logprobs(out, upto)
            self.chars, self.tokens = max(self.chars, end), upto
            if self.chat is None and oa.ChatStream.wanted(self.req, self.formats):
                self.chat = oa.ChatStream(self.req, self.formats, out.prompt)
            if self.chat is not None:
                chunks += self._chat_chunks(text, lp, out)
            elif text or lp is not None or out.finished:
                chunks.append(oa.stream_chunk(self.req, text=text, logprobs=lp,
                                              finish=out.finish_reason, **self.kw))
        return chunks

    def _chat_chunks(self, text: str, lp: Optional[dict], out) -> list[dict]:
        """Chunks of new text read as reasoning, content and tool calls: the logprobs with the
        first, the finish_reason with the last."""
        deltas = self.chat.add(text, final=out.finished)
        if not deltas and (lp is not None or out.finished):
            deltas = [{}]
        finish = self.chat.finish_reason(out.finish_reason) if out.finished else None
        return [oa.stream_chunk(self.req, delta=d, logprobs=lp if i == 0 else None,
                                finish=finish if i == len(deltas) - 1 else None, **self.kw)
                for i, d in enumerate(deltas)]

    def usage(self) -> Optional[dict]:
        if not self.req.include_usage or self.last is None:
            return None
        last = getattr(self.last, "request", self.last)  # the whole request: every sequence
        kw = {k: v for k, v in self.kw.items() if k != "index"}
        return oa.stream_chunk(self.req, usage_=oa.usage([last]), **kw)


def sse(payload) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class SSEResponse(Response):
    """An ASGI response streaming `events` (SSE-encoded bytes) with status 200. A client that
    disconnects cancels the stream wherever it waits (for the engine or on a write)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[bool], None]):
        self.events, self.on_close = events, on_close
        self.status_code, self.background = 200, None

    async def __call__(self, scope, receive, send) -> None:
        finished, gone, closing = False, asyncio.Event(), []
        main = asyncio.current_task()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            if not closing:
                main.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"),
                                    (b"x-accel-buffering", b"no")]})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            finished = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone.is_set():
                raise               # cancelled by the server (shutdown): pass it on
            main.uncancel()
        except OSError:             # the client went away mid-write
            pass
        finally:
            closing.append(True)
            watcher.cancel()
            try:
                await self.events.aclose()
            except asyncio.CancelledError:
                if not gone.is_set():
                    raise
            finally:
                self.on_close(finished)
