"""The mock's logprobs: deterministic, a function of the token id, its position in the reply and k.

The top ``k`` alternatives (most likely first) are ``-(0.7 + f + i)`` for rank ``i`` (their
probabilities sum below 1), ``f`` in [0, 0.25) from the id and position; the sampled token is among
them at rank ``(id + position) % k`` with that logprob. With ``k`` 0 only the sampled token's
logprob (rank 0's) is given. A migrated request continues at the position it reached, so its
logprobs are those an unmoved request gets.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynamo_prep.protocol.wire import TokenLogprob

__all__ = ["mock_logprob", "mock_logprobs"]

_OTHER_STRIDE = 7919  # a prime: the other top ids are spread over the vocabulary, none the sampled one


def _level(token_id: int, position: int, rank: int) -> float:
    return -(0.7 + ((token_id * 31 + position * 17) % 100) / 400 + rank)


def mock_logprob(token_id: int, position: int, k: int, n_vocab: int) -> TokenLogprob:
    """The record of ``token_id`` sampled at ``position`` (0-based in the reply) with ``k`` alternatives."""
    if k <= 0:
        return TokenLogprob(_level(token_id, position, 0))
    sampled_rank = (token_id + position) % k
    top: list[tuple[int, float]] = []
    for rank in range(k):
        other = (token_id + (rank + 1) * _OTHER_STRIDE) % n_vocab
        top.append((token_id if rank == sampled_rank else other, _level(token_id, position, rank)))
    return TokenLogprob(_level(token_id, position, sampled_rank), tuple(top))


def mock_logprobs(token_ids: Sequence[int], first_position: int, k: int, n_vocab: int) -> list[TokenLogprob]:
    return [mock_logprob(token_id, first_position + i, k, n_vocab) for i, token_id in enumerate(token_ids)]
