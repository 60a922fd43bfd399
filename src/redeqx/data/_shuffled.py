"""`shuffled`: a stream read through a seeded shuffle buffer, for `batches`
where ``shuffle=True`` needs ``len()``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._data import check_examples
from .._typing import positive_int, typechecked


def _key_words(key) -> tuple[int, ...]:
    """A PRNG key's raw ``uint32`` words, to seed NumPy with."""
    typed = isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if typed and key.shape == ():
        return tuple(int(w) for w in np.asarray(jax.random.key_data(key)).ravel())
    if not typed and isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32 and key.ndim == 1:
        return tuple(int(w) for w in np.asarray(key))  # a raw key, from jax.random.PRNGKey
    raise TypeError(
        f"key must be one PRNG key, e.g. key=jax.random.fold_in(jax.random.key(0), epoch) for a new order each "
        f"epoch, got {key!r}."
    )


class Shuffled:
    """A stream read through a seeded shuffle buffer; made by `shuffled`.
    Each ``iter()`` reads ``examples`` again and gives the same order."""

    def __init__(self, examples, buffer_size: int, seed: tuple[int, ...]):
        self.examples = examples
        self.buffer_size = buffer_size
        self.seed = seed

    def __repr__(self) -> str:
        return f"shuffled({type(self.examples).__name__}, buffer_size={self.buffer_size})"

    def __iter__(self) -> Iterator:
        # PCG64's raw words from a SeedSequence are the same in every NumPy
        # version (unlike Generator's methods), so a resumed run gets the order
        # it was saved in; a 64-bit word mod the buffer size is off uniform by
        # at most buffer_size / 2**64
        bits = np.random.PCG64(np.random.SeedSequence(self.seed))
        draws = itertools.chain.from_iterable(iter(lambda: bits.random_raw(1024).tolist(), None))
        buffer: list = []
        stream = iter(self.examples)
        try:
            for example in stream:
                if len(buffer) < self.buffer_size:
                    buffer.append(example)
                    continue
                j = next(draws) % self.buffer_size
                yield buffer[j]  # a random one of the buffer out, the new example in its place
                buffer[j] = example
        finally:
            if hasattr(stream, "close"):  # as `batches` does
                stream.close()
        for i in range(len(buffer) - 1, 0, -1):  # the stream has ended: what is left, in a random order
            j = next(draws) % (i + 1)
            buffer[i], buffer[j] = buffer[j], buffer[i]
        yield from buffer


@typechecked
def shuffled(examples: Any, buffer_size: int, *, key) -> Shuffled:
    """``examples`` (a stream, or a sequence) read through a shuffle buffer of
    ``buffer_size`` examples, seeded by ``key``: a stream you can pass to
    `batches` where ``shuffle=True`` needs ``len()``.

    The buffer holds the first ``buffer_size`` examples; each further example
    takes the place of one drawn at random from it, which is given out; at
    the end, what is left comes out in a random order. So an example moves
    at most ``buffer_size`` places earlier, and a buffer as large as the
    data is a full shuffle. The same ``key`` gives the same order on every
    process and in every run (NumPy's PCG64, seeded by the key's words), so
    ``batches(shuffled(...), ..., start=s)`` resumes exactly; pass a new key
    each epoch. Each ``iter()`` reads ``examples`` again, so it is a stream
    that starts over when ``examples`` does.

    **Example:**

    ```python
    for epoch in range(n_epochs):
        stream = redeqx.shuffled(read_jsonl("train.jsonl"), 10_000, key=jax.random.fold_in(key, epoch))
        for batch in redeqx.batches(stream, collate_fn, 32, mesh, drop_last=True):
            state, metrics = train_step(state, batch)
    ```
    """
    check_examples(examples)
    buffer_size = positive_int(buffer_size, "buffer_size")
    return Shuffled(examples, buffer_size, _key_words(key))
