"""Request schemas of the HTTP API (pydantic, as FastAPI validates them).

Only the OpenAI fields the pipeline honours are accepted; unknown fields are rejected
(``extra="forbid"``) so a typo is a 400 with the field's name, not a silently ignored
setting. Sampling values are range-checked here because a value vLLM rejects would
otherwise fail inside a stage process. Text the model reads (``prompt``, ``messages``,
``input``, ``negative_prompt``) is bounded by the first stage's context (the server counts
its tokens) and the body limit; every other text field has a short bound of its own.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

#: A name-like field (model, user, voice, size): nothing longer is meaningful.
Name = Annotated[str, StringConstraints(max_length=256)]
#: A stop string: vLLM matches it against the output, which is at most a context long.
Stop = Annotated[str, StringConstraints(max_length=1024)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingFields(_Request):
    """Sampling parameters forwarded to the pipeline's first stage."""

    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    stop: Stop | Annotated[list[Stop], Field(max_length=4)] | None = None  # OpenAI: up to 4
    n: int = Field(default=1, ge=1, le=1)
    user: Name | None = None

    def sampling_params(self) -> dict[str, Any]:
        out = {
            k: getattr(self, k)
            for k in ("max_tokens", "temperature", "top_p", "top_k", "seed")
            if getattr(self, k) is not None
        }
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return out


class CompletionRequest(SamplingFields):
    """``POST /v1/completions`` (one prompt per request)."""

    prompt: str | list[str]
    model: Name | None = None
    stream: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("exactly one prompt per request is supported")
        text = v if isinstance(v, str) else v[0]
        if not text:
            raise ValueError("prompt must not be empty")
        return v

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant"]
    content: str
    name: Name | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    model: Name | None = None
    stream: bool = False
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)

    def sampling_params(self) -> dict[str, Any]:
        out = super().sampling_params()
        if self.max_completion_tokens is not None:
            out["max_tokens"] = self.max_completion_tokens
        return out


class ImageRequest(_Request):
    """``POST /v1/images/generations``. kvbridge extensions: ``num_steps`` (denoise steps),
    ``guidance_scale`` (classifier-free guidance, 1 = off; default: the stage config's) and
    ``negative_prompt`` (the unconditional companion's prompt; default: the stage config's)."""

    prompt: str = Field(min_length=1)
    model: Name | None = None
    n: int = Field(default=1, ge=1, le=8)
    response_format: Literal["b64_json", "url"] = "b64_json"
    size: Name | None = None
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    num_steps: int | None = Field(default=None, ge=1, le=1000)
    guidance_scale: float | None = Field(default=None, ge=0, le=100)
    negative_prompt: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    user: Name | None = None


class SpeechRequest(_Request):
    """``POST /v1/audio/speech`` (pipelines ending in a vocoder stage). ``input`` is the
    first stage's prompt. ``response_format``: ``wav`` (16-bit mono) or ``pcm`` (raw 16-bit
    little-endian at the vocoder's sample rate); ``stream_format: sse`` streams each piece
    of audio as the vocoder makes it (``speech.audio.delta`` events, base64 PCM), ``audio``
    (the default) answers the whole file. ``voice`` is accepted for OpenAI clients, which
    always send one; the pipeline's model has one voice. ``max_tokens`` bounds the first
    stage's generation (a kvbridge extension)."""

    input: str = Field(min_length=1)
    model: Name | None = None
    voice: Name | None = None
    response_format: Literal["wav", "pcm"] = "wav"
    stream_format: Literal["audio", "sse"] = "audio"
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
