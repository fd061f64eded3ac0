"""The zigzag layout helpers, in one process: against a position-by-position reference, round trips, padding."""

import pytest
import torch

from hf_spec_cotrain.attention.masks import block_mask, document_ids, positions_in_document
from hf_spec_cotrain.parallel import (
    pad_documents,
    zigzag_indices,
    zigzag_owner,
    zigzag_position_ids,
    zigzag_shard,
    zigzag_unshard,
)
from hf_spec_cotrain.parallel.zigzag import ring_steps


def naive_layout(doc_lengths: list[int], rank: int, world_size: int) -> tuple[list[int], list[int]]:
    """Global indices and within-document positions of a rank's shard, spelled out chunk by chunk."""
    indices, positions = [], []
    start = 0
    for n in doc_lengths:
        chunk = n // (2 * world_size)
        for chunk_index in (rank, 2 * world_size - 1 - rank):
            offsets = range(chunk_index * chunk, (chunk_index + 1) * chunk)
            indices += [start + offset for offset in offsets]
            positions += list(offsets)
        start += n
    return indices, positions


def random_layout(generator: torch.Generator, world_size: int, *, allow_empty: bool = True) -> list[int]:
    num_docs = int(torch.randint(1, 6, (), generator=generator))
    lengths = (2 * world_size * torch.randint(0 if allow_empty else 1, 7, (num_docs,), generator=generator)).tolist()
    if sum(lengths) == 0:
        lengths[0] = 2 * world_size
    return lengths


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_indices_and_positions_match_the_layout(world_size):
    generator = torch.Generator().manual_seed(world_size)
    for _ in range(20):
        lengths = random_layout(generator, world_size)
        cu_seqlens = cu_of(lengths)
        seen = []
        for rank in range(world_size):
            indices, positions = naive_layout(lengths, rank, world_size)
            assert zigzag_indices(rank, world_size, cu_seqlens=cu_seqlens).tolist() == indices
            assert zigzag_position_ids(rank, world_size, cu_seqlens=cu_seqlens).tolist() == positions
            owner, local = zigzag_owner(torch.tensor(indices, dtype=torch.int64), world_size, cu_seqlens.long())
            assert owner.tolist() == [rank] * len(indices)
            assert local.tolist() == list(range(len(indices)))
            seen += indices
        assert sorted(seen) == list(range(sum(lengths)))  # the shards partition the sequence


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_steps_are_those_where_some_rank_sees_some_key(world_size):
    """Against the dense windowed mask between every pair of shards: no needed step is left out, none is extra."""
    generator = torch.Generator().manual_seed(world_size)
    fewer = 0
    for trial in range(40):
        lengths = random_layout(generator, world_size)
        cu_seqlens = cu_of(lengths)
        window = None if trial == 0 else int(torch.randint(1, 30, (), generator=generator))
        doc_ids = document_ids(cu_seqlens)
        shards = [zigzag_indices(rank, world_size, cu_seqlens=cu_seqlens) for rank in range(world_size)]
        needed = {
            (rank - source) % world_size
            for rank, queries in enumerate(shards)
            for source, keys in enumerate(shards)
            if block_mask(queries, doc_ids[queries], keys, doc_ids[keys], window).any()
        }
        assert ring_steps(world_size, window, cu_seqlens=cu_seqlens) == sorted(needed), (lengths, window)
        fewer += len(needed) < world_size
        chunk = min(length for length in lengths if length) // (2 * world_size)
        if window is not None and 1 < window <= chunk + 1:  # only the neighbouring chunks' ranks
            assert sorted(needed) == sorted({0, 1 % world_size, (world_size - 1) % world_size})
    assert ring_steps(world_size, None, length=0) == list(range(world_size))
    assert world_size < 4 or fewer > 2  # windows that skip steps were drawn


def test_one_document_without_cu_seqlens():
    assert zigzag_indices(1, 2, length=8).tolist() == [2, 3, 4, 5]
    assert zigzag_indices(0, 2, length=8).tolist() == [0, 1, 6, 7]
    assert zigzag_position_ids(2, 4, length=16).tolist() == [4, 5, 10, 11]


@pytest.mark.parametrize("dim", [0, 1, -2])
@pytest.mark.parametrize("packed", [True, False])
def test_shard_unshard_round_trip(dim, packed):
    generator = torch.Generator().manual_seed(3 + dim)
    for world_size in (1, 2, 4):
        lengths = random_layout(generator, world_size)
        length = sum(lengths)
        cu_seqlens = cu_of(lengths) if packed else None
        shape = [3, 5, 2]
        shape[dim] = length
        x = torch.randn(*shape, generator=generator, dtype=torch.float64)
        shards = [zigzag_shard(x, dim, rank, world_size, cu_seqlens) for rank in range(world_size)]
        for rank, shard in enumerate(shards):
            indices = naive_layout(lengths if packed else [length], rank, world_size)[0]
            torch.testing.assert_close(shard, x.index_select(dim, torch.tensor(indices)), rtol=0, atol=0)
        torch.testing.assert_close(zigzag_unshard(shards, dim, cu_seqlens), x, rtol=0, atol=0)


def test_shard_is_differentiable():
    x = torch.randn(1, 16, 3, dtype=torch.float64, requires_grad=True)
    cu_seqlens = torch.tensor([0, 4, 16])
    weights = torch.randn(1, 8, 3, dtype=torch.float64)
    (zigzag_shard(x, 1, 1, 2, cu_seqlens) * weights).sum().backward()
    expected = torch.zeros_like(x)
    expected[:, zigzag_indices(1, 2, cu_seqlens=cu_seqlens)] = weights
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


def test_pad_documents():
    generator = torch.Generator().manual_seed(5)
    for world_size in (1, 2, 3, 4):
        for _ in range(10):
            lengths = torch.randint(0, 20, (int(torch.randint(1, 5, (), generator=generator)),), generator=generator)
            cu_seqlens = cu_of(lengths.tolist())
            padding = pad_documents(cu_seqlens, world_size=world_size)
            padded_lengths = torch.diff(padding.cu_seqlens)
            assert bool((padded_lengths % (2 * world_size) == 0).all())
            assert bool(((padded_lengths >= lengths) & (padded_lengths < lengths + 2 * world_size)).all())
            assert int(padding.real_mask.sum()) == int(lengths.sum())
            # Real tokens keep their within-document positions and stay in order at the head of their document.
            padded_positions = positions_in_document(padding.cu_seqlens)
            torch.testing.assert_close(padded_positions[padding.index], positions_in_document(cu_seqlens))
            assert bool(
                (padded_positions[~padding.real_mask] >= lengths.repeat_interleave(padded_lengths - lengths)).all()
            )
            x = torch.randn(2, int(lengths.sum()), 3, generator=generator, dtype=torch.float64, requires_grad=True)
            padded = padding.pad(x, dim=1, value=-7.0)
            assert bool((padded[:, ~padding.real_mask] == -7.0).all())
            torch.testing.assert_close(padding.unpad(padded, dim=1), x, rtol=0, atol=0)
            padded.sum().backward()
            torch.testing.assert_close(x.grad, torch.ones_like(x), rtol=0, atol=0)
            # The padded documents can be sharded.
            shards = [zigzag_shard(padded, 1, rank, world_size, padding.cu_seqlens) for rank in range(world_size)]
            torch.testing.assert_close(zigzag_unshard(shards, 1, padding.cu_seqlens), padded, rtol=0, atol=0)


def test_pad_bool_mask():
    padding = pad_documents(torch.tensor([0, 3, 8]), world_size=2)
    assert padding.cu_seqlens.tolist() == [0, 4, 12]
    mask = padding.pad(torch.ones(1, 8, dtype=torch.bool), value=False)
    assert mask.tolist() == [[True, True, True, False, True, True, True, True, True, False, False, False]]
    assert torch.equal(mask[0], padding.real_mask)


def test_invalid_arguments():
    x = torch.randn(2, 12)
    cu_seqlens = torch.tensor([0, 4, 12])
    with pytest.raises(ValueError, match=r"multiple of 2 \* world_size = 8 .* got length 4 for document 0"):
        zigzag_shard(x, 1, 0, 4, cu_seqlens)
    with pytest.raises(ValueError, match="pad_documents"):
        zigzag_indices(0, 4, length=12)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\), got 2"):
        zigzag_shard(x, 1, 2, 2, cu_seqlens)
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        zigzag_shard(x, 1, 0, 0)
    with pytest.raises(ValueError, match=r"dim must be an int in \[-2, 2\) for a 2-D tensor, got 2"):
        zigzag_shard(x, 2, 0, 2)
    with pytest.raises(ValueError, match=r"end at the sequence length L=2, got first=0 and last=12"):
        zigzag_shard(x, 0, 0, 1, cu_seqlens)
    with pytest.raises(ValueError, match="non-decreasing"):
        zigzag_indices(0, 1, cu_seqlens=torch.tensor([0, 8, 4, 12]))
    with pytest.raises(ValueError, match="same shape"):
        zigzag_unshard([torch.zeros(4), torch.zeros(2)], 0)
    with pytest.raises(ValueError, match="non-empty sequence"):
        zigzag_unshard([], 0)
    with pytest.raises(ValueError, match="integer dtype"):
        pad_documents(torch.tensor([0.0, 3.0]), world_size=2)
    padding = pad_documents(torch.tensor([0, 3]), world_size=2)
    with pytest.raises(ValueError, match="x has length 4 along dim 1; the documents hold 3"):
        padding.pad(torch.zeros(1, 4))
