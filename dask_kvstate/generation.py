"""What generating operators return: the text, with its token ids and timings attached."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from dask_kvstate import config


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
    the state's own, else the first). ``None`` means the default, read from the config of
    the process that builds the task (the client; see :func:`fixed_options`).
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


def fixed_options(options: Mapping[str, Any], call: str) -> dict[str, Any]:
    """Every :class:`DecodeOptions` keyword as the call will run it: ``kvstate.generate.*`` of
    *this* process filled in where ``options`` says None, checked and normalised.

    ``kvs.generate`` and friends call this where the graph is built, so the task's
    arguments (and so its key) are what runs: a worker with another config cannot change a
    call, and two calls are deduplicated only if they really decode the same way (equal
    ``temperature=0`` and ``0.0`` alike). ``seed`` stays as given (None: a fresh draw per
    run), and ``model`` too (None: the state's own, else the first given to ``kvs.install``,
    which is fixed by the install, not by a config read at run time). Raises TypeError for
    an unknown keyword and ValueError naming a bad value.

    Examples
    --------
    >>> import dask
    >>> with dask.config.set({"kvstate.generate.temperature": 0.8}):
    ...     opts = fixed_options({"max_new_tokens": 8}, "generate")
    >>> opts["max_new_tokens"], opts["temperature"], opts["seed"]
    (8, 0.8, None)
    >>> fixed_options({"temperature": 0}, "generate") == fixed_options({}, "generate")
    True
    """
    opts = decode_options(options, call)
    sampling = Sampling.from_options(opts)
    return {
        **opts,
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
    }


@dataclass(frozen=True)
class Sampling:
    """How to decode, checked once and carried from the task down to the model.

    The one value every generating path passes on (as vLLM's ``SamplingParams``):
    ``max_new_tokens``; ``temperature`` (0 is greedy); ``top_p`` (nucleus sampling);
    ``seed`` (the sampler's seed; None draws one). Raises ValueError naming a bad field.

    Examples
    --------
    >>> Sampling(8)
    Sampling(max_new_tokens=8, temperature=0.0, top_p=1.0, seed=None)
    >>> Sampling(8, top_p=0)
    Traceback (most recent call last):
    ...
    ValueError: top_p must be in (0, 1], got 0
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {self.max_new_tokens!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an int or None (None: a fresh draw), got {self.seed!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Sampling:
        """The sampling of :class:`DecodeOptions`, with ``kvstate.generate.*`` where they say None.

        >>> Sampling.from_options({"max_new_tokens": 4, "seed": 1}).seed
        1
        """

        def pick(name: str, key: str):
            return config.get(f"generate.{key}") if options.get(name) is None else options[name]

        return cls(
            max_new_tokens=pick("max_new_tokens", "max-new-tokens"),
            temperature=pick("temperature", "temperature"),
            top_p=pick("top_p", "top-p"),
            seed=options.get("seed"),
        )
