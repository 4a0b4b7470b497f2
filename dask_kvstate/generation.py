"""What generating operators return: the text, with its token ids and timings attached."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict


class Generation(str):
    """Generated text (a ``str``) that also carries how it was produced.

    Attributes: ``token_ids`` (the new tokens), ``prompt_tokens``, ``reused_tokens``
    (prompt tokens whose KV came from a state), ``prefill_tokens``, ``ttft`` (seconds
    from the task's start to the first new token), ``prefill_s``, ``decode_s``.
    Being a ``str`` it drops into any downstream task that expects text.

    Examples
    --------
    >>> g = Generation("hi", token_ids=[5, 6], ttft=0.1)
    >>> g.upper(), g.token_ids
    ('HI', [5, 6])
    >>> import pickle; pickle.loads(pickle.dumps(g)).token_ids
    [5, 6]
    """

    token_ids: list[int]
    #: set on the rows of one batched decode (``resume_many``): the batch's id and size
    batch_id: str
    batch_rows: int

    def __new__(cls, text: str, **info):
        self = super().__new__(cls, text)
        self.__dict__.update(info)
        return self

    def __reduce__(self):
        return (_rebuild, (str(self), self.__dict__))

    @classmethod
    def from_result(cls, backend, res, prompt_ids) -> Generation:
        return cls(
            backend.detokenize(res.token_ids),
            token_ids=list(res.token_ids),
            prompt_tokens=len(prompt_ids),
            reused_tokens=res.reused_tokens,
            prefill_tokens=res.prefill_tokens,
            ttft=res.ttft,
            prefill_s=res.prefill_s,
            decode_s=res.decode_s,
        )


def _rebuild(text: str, info: dict) -> Generation:
    return Generation(text, **info)


class DecodeOptions(TypedDict, total=False):
    """The keywords every generating call takes: ``generate``, ``resume``, ``resume_many``.

    ``max_new_tokens`` (default ``kvstate.generate.max-new-tokens``), ``temperature``
    (0 is greedy; default ``kvstate.generate.temperature``), ``top_p`` (default
    ``kvstate.generate.top-p``), ``seed`` (for sampling; sampling without one is never
    deduplicated) and ``model`` (one of the models given to ``kvs.install``; default:
    the state's own, else the first). ``None`` means the default.
    """

    max_new_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    model: str | None


DECODE_OPTIONS = tuple(DecodeOptions.__annotations__)


def decode_options(options: Mapping[str, Any], call: str) -> dict[str, Any]:
    """Every :class:`DecodeOptions` keyword, ``None`` where not given.

    Raises TypeError naming a keyword ``call`` does not take, at once (not later in a
    task on a worker).

    Examples
    --------
    >>> decode_options({"max_new_tokens": 8}, "resume")["max_new_tokens"], decode_options({}, "resume")["seed"]
    (8, None)
    >>> decode_options({"max_tokens": 8}, "resume")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: resume() got an unexpected keyword argument 'max_tokens'; it takes max_new_tokens, ...
    """
    for name in options:
        if name not in DECODE_OPTIONS:
            raise TypeError(
                f"{call}() got an unexpected keyword argument {name!r}; it takes {', '.join(DECODE_OPTIONS)}"
            )
    return {name: options.get(name) for name in DECODE_OPTIONS}
