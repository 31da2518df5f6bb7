"""Feeds checked requests (Work) to an LLM and turns finished ones into output records, for the
local runner and the Ray actors. A request's failure becomes its own error record (400 for a
refusal, 500 for a bug, logged); the job goes on."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from jaxinfer.batch import records
from jaxinfer.batch.inputs import Work
from jaxinfer.batch.records import Result
from jaxinfer.openai_api import CHAT, ChatFormats, RequestError, prepare, response_body
from jaxinfer.responses_api import response_object

logger = logging.getLogger(__name__)


class EngineFeeder:
    """add_request / step for Work items, each with a caller's tag (where its Result goes). A
    request with no seed gets records.derive_seed(job_seed, custom_id)."""

    def __init__(self, llm, model_name: str, job_seed: Optional[int]):
        if llm.tokenizer is None:  # response bodies carry text
            raise ValueError(f"model {model_name!r} has no tokenizer: a batch job's responses "
                             "hold text, so it needs one")
        self.llm, self.model_name, self.job_seed = llm, model_name, job_seed
        self.formats = ChatFormats.for_tokenizer(llm.tokenizer)
        self._running: dict[str, tuple[Work, Any]] = {}

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def submit(self, work: Work, tag: Any) -> Optional[Result]:
        """Adds the request; None, or the request's error Result when it is refused."""
        rid = f"batch:{work.line}"  # LLM's own ids are bare numbers
        try:
            return self._submit(work, rid, tag)
        except Exception:  # noqa: BLE001 - a bug, but one request's: the others go on
            logger.exception("line %d: submitting the request failed", work.line + 1)
            try:  # in case the engine holds it already
                self.llm.abort(rid)
            except Exception:  # noqa: BLE001 - best effort; the failure is logged above
                pass
            return records.internal_error(work.line, work.custom_id,
                                          "the request could not be submitted")

    def _submit(self, work: Work, rid: str, tag: Any) -> Optional[Result]:
        req = work.request
        if req.n > self.llm.max_n:
            return records.request_error(work.line, work.custom_id, RequestError(
                f"n={req.n} exceeds the limit of {self.llm.max_n} sequences per request", "n"),
                records.INVALID_REQUEST)
        field = "messages" if req.endpoint == CHAT else "prompt"
        try:
            prompt, params = prepare(self.llm, req, self.formats)
        except RequestError as e:
            kind = records.INVALID_REQUEST if e.param != field else \
                records.PROMPT_TOO_LONG if "max_seq_len" in e.message else records.INVALID_PROMPT
            return records.request_error(work.line, work.custom_id, e, kind)
        if params.seed is None:
            params = dataclasses.replace(
                params, seed=records.derive_seed(self.job_seed, work.custom_id))
        # A line's `model` naming a loaded LoRA adapter runs under it; any other is the model.
        lora = req.model if req.model in {a["name"] for a in self.llm.list_loras()} else None
        try:
            self.llm.add_request(prompt, params, request_id=rid, lora=lora)
        except ValueError as e:
            return records.request_error(work.line, work.custom_id, RequestError(str(e), field),
                                         records.INVALID_PROMPT)
        self._running[rid] = (work, tag)
        return None

    def step(self) -> list[tuple[Any, Result]]:
        """One engine step; (tag, Result) of each request that finished in it."""
        done = []
        for out in self.llm.step():
            if not out.finished:
                continue
            work, tag = self._running.pop(out.request_id)
            done.append((tag, self._finished(work, out)))
        return done

    def _finished(self, work: Work, out) -> Result:
        if out.finish_reason == "error" or any(c.finish_reason == "error" for c in out.outputs):
            # The engine logged the traceback when the request's bookkeeping raised.
            return records.internal_error(work.line, work.custom_id,
                                          "the engine failed on this request")
        try:
            body = response_body(work.request, self.llm.tokenizer, [out], model=self.model_name,
                                 formats=self.formats)
            if work.responses_body is not None:
                body = response_object(body, request_body=work.responses_body)
            return records.success(work.line, work.custom_id, body)
        except Exception:  # noqa: BLE001 - a bug, but one request's: the others go on
            logger.exception("line %d: building the response failed", work.line + 1)
            return records.internal_error(work.line, work.custom_id,
                                          "the response could not be built")

    def abort_all(self) -> None:
        """Drops every running request (the job is stopping; they are redone on resume)."""
        for rid in list(self._running):
            self.llm.abort(rid)
        self._running.clear()
