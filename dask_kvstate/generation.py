"""What generating operators return: the text, with its token ids and timings attached."""

from __future__ import annotations


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
