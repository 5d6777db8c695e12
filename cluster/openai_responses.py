"""OpenAI-compatible responses at the HTTP door, built from the replicas' chunks with vLLM's own protocol
models: whole responses (``ChatCompletionResponse``, ``CompletionResponse``), server-sent-event chunks
(``ChatCompletionStreamResponse``, ``CompletionStreamResponse``, then ``data: [DONE]``) and errors in OpenAI's
error JSON (``ErrorResponse``). A stream that fails after its first chunk ends with an error event, which the
OpenAI client raises as an APIError: never a clean end after a truncated answer.
"""

from __future__ import annotations

import time

from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, UsageInfo

from actors.engines import Chunk, TokenLogprob

# Refused.code -> HTTP status; and the error type OpenAI's client names its exception after.
HTTP_STATUS = {
    "invalid_argument": 400,
    "unauthenticated": 401,
    "not_found": 404,
    "resource_exhausted": 429,
    "internal": 500,
    "unavailable": 503,
    "deadline_exceeded": 504,
}
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    info = ErrorInfo(message=message, type=ERROR_TYPES.get(status, "Error"), param=param, code=status)
    return ErrorResponse(error=info).model_dump()


def sse(obj) -> str:
    return f"data: {obj.model_dump_json(exclude_unset=True)}\n\n"


DONE = "data: [DONE]\n\n"


class Answer:
    """One request's answer as its chunks arrive: the text, the tokens, their log-probabilities."""

    def __init__(
        self, kind: str, rid: str, model: str, prompt_tokens: int, logprobs: bool, continuous_usage: bool = False
    ):
        self.chat = kind == "chat"
        # stream_options.continuous_usage_stats (with include_usage), as vLLM serves it: every chunk carries the
        # usage so far (GuideLLM sends it on every streamed request).
        self.continuous_usage = continuous_usage
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{rid}"
        self.model, self.prompt_tokens, self.want_logprobs = model, prompt_tokens, logprobs
        self.created = int(time.time())
        self.text: list[str] = []
        self.tokens = 0
        self.logprobs: list[TokenLogprob] = []
        self.offset = 0  # characters of text so far (completions' text_offset)
        self.finish_reason: str | None = None

    def add(self, c: Chunk) -> None:
        self.text.append(c.text)
        self.tokens += len(c.token_ids)
        self.logprobs.extend(c.logprobs)
        if c.finished:
            self.finish_reason = c.finish_reason or "stop"

    def usage(self) -> UsageInfo:
        n, m = self.prompt_tokens, self.tokens
        return UsageInfo(prompt_tokens=n, completion_tokens=m, total_tokens=n + m)

    # ------------------------------------------------------------------ whole responses
    def response(self) -> dict:
        text = "".join(self.text)
        if self.chat:
            choice = ChatCompletionResponseChoice(
                index=0,
                message=ChatMessage(role="assistant", content=text),
                logprobs=chat_logprobs(self.logprobs) if self.want_logprobs else None,
                finish_reason=self.finish_reason,
            )
            out = ChatCompletionResponse(
                id=self.id, created=self.created, model=self.model, choices=[choice], usage=self.usage()
            )
        else:
            choice = CompletionResponseChoice(
                index=0,
                text=text,
                logprobs=self._completion_logprobs(self.logprobs) if self.want_logprobs else None,
                finish_reason=self.finish_reason,
            )
            out = CompletionResponse(
                id=self.id, created=self.created, model=self.model, choices=[choice], usage=self.usage()
            )
        return out.model_dump(mode="json")

    # ------------------------------------------------------------------ streams
    def first_event(self) -> str:
        """Chat streams open with the assistant's role (as OpenAI's do); completions have no such chunk."""
        if not self.chat:
            return ""
        delta = DeltaMessage(role="assistant", content="")
        return sse(self._chunk(ChatCompletionResponseStreamChoice(index=0, delta=delta, finish_reason=None), True))

    def event(self, c: Chunk) -> str:
        self.add(c)
        finish = self.finish_reason if c.finished else None
        if self.chat:
            choice = ChatCompletionResponseStreamChoice(
                index=0,
                delta=DeltaMessage(content=c.text),
                logprobs=chat_logprobs(c.logprobs) if self.want_logprobs else None,
                finish_reason=finish,
            )
        else:
            choice = CompletionResponseStreamChoice(
                index=0,
                text=c.text,
                logprobs=self._completion_logprobs(c.logprobs) if self.want_logprobs else None,
                finish_reason=finish,
            )
        return sse(self._chunk(choice, True))

    def usage_event(self) -> str:
        """stream_options.include_usage: a last chunk with no choices and the usage."""
        cls, kind = (
            (ChatCompletionStreamResponse, "chat.completion.chunk")
            if self.chat
            else (CompletionStreamResponse, "text_completion")
        )
        return sse(cls(id=self.id, object=kind, created=self.created, model=self.model, choices=[], usage=self.usage()))

    def _chunk(self, choice, with_usage: bool = False):
        """One stream chunk; with continuous usage stats on, the usage so far rides on it (vLLM's
        chat_completion/serving.py and completion/serving.py ``include_continuous_usage``)."""
        usage = {"usage": self.usage()} if with_usage and self.continuous_usage else {}
        if self.chat:
            return ChatCompletionStreamResponse(
                id=self.id, object="chat.completion.chunk", created=self.created, model=self.model, choices=[choice],
                **usage,
            )  # fmt: skip
        return CompletionStreamResponse(
            id=self.id, object="text_completion", created=self.created, model=self.model, choices=[choice], **usage
        )

    def _completion_logprobs(self, lps: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> CompletionLogProbs:
        offsets = []
        for t in lps:
            offsets.append(self.offset)
            self.offset += len(t.token)
        return CompletionLogProbs(
            text_offset=offsets,
            token_logprobs=[t.logprob for t in lps],
            tokens=[t.token for t in lps],
            top_logprobs=[{tok: lp for _, tok, lp in t.top} for t in lps],
        )


def chat_logprobs(lps) -> ChatCompletionLogProbs:
    return ChatCompletionLogProbs(
        content=[
            ChatCompletionLogProbsContent(
                token=t.token,
                logprob=t.logprob,
                bytes=list(t.token.encode()),
                top_logprobs=[ChatCompletionLogProb(token=s, logprob=lp, bytes=list(s.encode())) for _, s, lp in t.top],
            )
            for t in lps
        ]
    )
