"""Context-parallel branch attention (ring and all-gather) on gloo against the dense float64 reference.

Every rank builds the same full inputs from a seed, runs the dense reference on them, and checks that its zigzag
shard of the output and of every input gradient matches the shard of the reference's (the sinks' gradient: its sum
over the group, as for any replicated parameter).
"""

import pytest
import torch
import torch.distributed as dist
from process_pool import subgroup

from hf_spec_cotrain.attention import blockwise, branch_attention, branch_attention_reference
from hf_spec_cotrain.attention.api import CONTEXT_PARALLEL_KERNELS, CP_MODES
from hf_spec_cotrain.attention.ring import sharded_branch_attention
from hf_spec_cotrain.parallel import zigzag_shard
from hf_spec_cotrain.parallel.comm import RingComm
from hf_spec_cotrain.parallel.zigzag import ring_steps, zigzag_indices


pytestmark = pytest.mark.distributed
POOL_WORLD_SIZE = 4
NAMES = ("out", "dq", "dk", "dv", "dbranch_k", "dbranch_v", "dsinks")


def random_case(seed: int, world_size: int) -> dict:
    """Packed documents of uneven lengths (multiples of 2W, some empty) with B = 1, or B > 1 unpacked rows."""
    generator = torch.Generator().manual_seed(seed)

    def randint(low, high):  # inclusive
        return int(torch.randint(low, high + 1, (), generator=generator))

    multiple = 2 * world_size
    num_kv_heads = randint(1, 2)
    case = {
        "seed": seed,
        "num_kv_heads": num_kv_heads,
        "num_q_heads": num_kv_heads * randint(1, 3),
        "head_dim": (4, 8)[randint(0, 1)],
        "num_branch": randint(0, 3),
        "block_size": (randint(1, 8), 256)[randint(0, 3) // 3],
        "scale": (None, 0.7)[randint(0, 1)],
        "branch_as_none": randint(0, 1) == 1,
    }
    if randint(0, 2):
        lengths = [multiple * randint(0, 4) for _ in range(randint(1, 4))]
        lengths[randint(0, len(lengths) - 1)] += multiple  # never all empty
        case.update(batch_size=1, doc_lengths=lengths, length=sum(lengths))
    else:
        case.update(batch_size=randint(2, 3), doc_lengths=None, length=multiple * randint(1, 4))
    # Windows shorter than, as long as and longer than the chunks (of 0 to 5 positions), or none.
    case.update(window=(None, randint(1, 3), randint(4, 12), randint(13, 40))[randint(0, 3)], sinks=randint(0, 1) == 1)
    return case


def make_inputs(case: dict, dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(case["seed"])
    kv_shape = (case["batch_size"], case["num_kv_heads"], case["length"], case["head_dim"])

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    inputs = {
        "q": randn(case["batch_size"], case["num_q_heads"], case["length"], case["head_dim"]),
        "k": randn(*kv_shape),
        "v": randn(*kv_shape),
        "branch_k": randn(case["num_branch"], *kv_shape),
        "branch_v": randn(case["num_branch"], *kv_shape),
    }
    if case["num_branch"] == 0 and case["branch_as_none"]:
        inputs.update(branch_k=None, branch_v=None)
    inputs["sinks"] = randn(case["num_q_heads"]) * 2 if case.get("sinks") else None
    return inputs


def cu_seqlens_of(case: dict) -> torch.Tensor | None:
    if case["doc_lengths"] is None:
        return None
    return torch.tensor([0, *torch.tensor(case["doc_lengths"]).cumsum(0).tolist()], dtype=torch.int32)


def outputs_and_grads(fn, inputs: dict, upstream: torch.Tensor, **kwargs) -> list[torch.Tensor | None]:
    leaves = {name: None if t is None else t.detach().clone().requires_grad_() for name, t in inputs.items()}
    out = fn(**leaves, **kwargs)
    out.backward(upstream.to(out.dtype))
    names = [name for name in ("q", "k", "v", "branch_k", "branch_v", "sinks") if name in leaves]
    return [out.detach(), *(None if leaves[name] is None else leaves[name].grad for name in names)]


def context_parallel_attention(group: dist.ProcessGroup, mode: str):
    """The public entry for W > 1; the strategy itself for W = 1 (branch_attention would take
    the single-device path)."""
    if dist.get_world_size(group) == 1:
        return lambda **kwargs: sharded_branch_attention(CONTEXT_PARALLEL_KERNELS[mode], **kwargs, group=group)
    return lambda **kwargs: branch_attention(**kwargs, cp_group=group, cp_mode=mode)


def check_case(case: dict, dtype: torch.dtype, group: dist.ProcessGroup, mode: str) -> None:
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    cu_seqlens = cu_seqlens_of(case)
    inputs = make_inputs(case, dtype)
    upstream = torch.randn(inputs["q"].shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    exact = {name: None if t is None else t.double() for name, t in inputs.items()}
    options = dict(cu_seqlens=cu_seqlens, scale=case["scale"], sliding_window=case["window"])
    expected = outputs_and_grads(branch_attention_reference, exact, upstream, **options)

    def shard(tensor, dim=2):
        return None if tensor is None else zigzag_shard(tensor, dim, rank, world_size, cu_seqlens)

    shards = {name: shard(t, 3 if name.startswith("branch") else 2) for name, t in inputs.items() if name != "sinks"}
    shards["sinks"] = inputs["sinks"]  # replicated, like the parameter it is
    actual = outputs_and_grads(
        context_parallel_attention(group, mode), shards, shard(upstream), block_size=case["block_size"], **options
    )
    if actual[-1] is not None:
        dist.all_reduce(actual[-1], group=group)
    tolerance = {"rtol": 0, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    for index, (name, got, want) in enumerate(zip(NAMES, actual, expected)):
        if (name.startswith("dbranch") and case["num_branch"] == 0) or (name == "dsinks" and not case["sinks"]):
            assert got is None and want is None, name  # an empty branch, or no sinks: not part of the graph
            continue
        if name != "dsinks":
            want = shard(want, 3 if index >= 4 else 2)
        assert got.dtype == dtype, name
        torch.testing.assert_close(got, want.to(dtype), **tolerance, msg=lambda m, n=name, c=case: f"{n} {c}: {m}")


def check_cases(size: int, mode: str, cases_per_group: list[list[dict]]) -> int:
    """Runs on every pool rank: each group of `size` ranks checks its own list of cases."""
    group = subgroup(size)
    checked = 0
    for case in cases_per_group[dist.get_rank() // size]:
        for dtype in (torch.float64, torch.float32):
            check_case(case, dtype, group, mode)
            checked += 1
    return checked


@pytest.mark.parametrize("mode", CP_MODES)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_matches_dense_reference(cp_pool, world_size, mode):
    num_groups = POOL_WORLD_SIZE // world_size
    cases_per_group = [
        [random_case(1000 * world_size + 10 * group + index, world_size) for index in range(8 // num_groups + 2)]
        for group in range(num_groups)
    ]
    checked = cp_pool.run(check_cases, world_size, mode, cases_per_group)
    assert checked == [2 * len(cases_per_group[rank // world_size]) for rank in range(POOL_WORLD_SIZE)]


def query_positions_of(case: dict, world_size: int) -> torch.Tensor:
    """The global positions that have a query (the same on every rank): a random subset of some density, and in
    half the cases none of one rank's positions (an empty query set there)."""
    generator = torch.Generator().manual_seed(case["seed"] + 1)
    density = float(torch.rand((), generator=generator)) * 0.8 + 0.1
    kept = torch.rand(case["length"], generator=generator) < density
    if torch.rand((), generator=generator) < 0.5:
        empty_rank = int(torch.randint(world_size, (), generator=generator))
        kept[zigzag_indices(empty_rank, world_size, cu_seqlens=cu_seqlens_of(case), length=case["length"])] = False
    return kept.nonzero().flatten()


def reference_at_rows(q, k, v, branch_k, branch_v, sinks, *, query_index, **kwargs):
    """The dense reference for queries at `query_index` only: the full call with zero queries and branch keys
    elsewhere, its output read at those rows (so the other rows get no upstream gradient)."""
    length = k.shape[2]
    full_q = q.new_zeros(*q.shape[:2], length, q.shape[3]).index_copy(2, query_index, q)
    full_branch = [
        None if b is None else b.new_zeros(*b.shape[:3], length, b.shape[4]).index_copy(3, query_index, b)
        for b in (branch_k, branch_v)
    ]
    out = branch_attention_reference(full_q, k, v, *full_branch, sinks=sinks, **kwargs)
    return out.index_select(2, query_index)


def check_query_index_case(case: dict, dtype: torch.dtype, group: dist.ProcessGroup, mode: str) -> int:
    """Queries at some local positions of every rank (`query_index`): this rank's output and gradient rows equal
    the dense reference's and the single-device call's at the same global positions; returns its query count."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    cu_seqlens = cu_seqlens_of(case)
    global_index = query_positions_of(case, world_size)
    shard_positions = zigzag_indices(rank, world_size, cu_seqlens=cu_seqlens, length=case["length"])
    local_index = torch.isin(shard_positions, global_index).nonzero().flatten()
    rows = torch.searchsorted(global_index, shard_positions[local_index])  # this rank's rows of the global call

    inputs = make_inputs(case, dtype)
    at_queries = {"q": 2, "branch_k": 3, "branch_v": 3}  # the per-query tensors and their sequence dimension
    for name, dim in at_queries.items():
        if inputs[name] is not None:
            inputs[name] = inputs[name].index_select(dim, global_index)
    upstream = torch.randn(inputs["q"].shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    options = dict(cu_seqlens=cu_seqlens, scale=case["scale"], sliding_window=case["window"])
    exact = {name: None if t is None else t.double() for name, t in inputs.items()}
    references = [
        outputs_and_grads(reference_at_rows, exact, upstream, query_index=global_index, **options),
        outputs_and_grads(
            branch_attention, inputs, upstream, query_index=global_index, block_size=case["block_size"], **options
        ),
    ]

    def local(name, tensor):
        if tensor is None or name == "dsinks":
            return tensor
        if name in ("dk", "dv"):
            return zigzag_shard(tensor, 2, rank, world_size, cu_seqlens)
        return tensor.index_select(3 if "branch" in name else 2, rows)

    shards = {name: None if inputs[name] is None else local(name, inputs[name]) for name in at_queries}
    shards.update({name: zigzag_shard(inputs[name], 2, rank, world_size, cu_seqlens) for name in ("k", "v")})
    shards["sinks"] = inputs["sinks"]  # replicated, like the parameter it is
    actual = outputs_and_grads(
        context_parallel_attention(group, mode),
        shards,
        local("out", upstream),
        query_index=local_index,
        block_size=case["block_size"],
        **options,
    )
    if actual[-1] is not None:
        dist.all_reduce(actual[-1], group=group)
    tolerance = {"rtol": 0, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    for expected in references:
        for name, got, want in zip(NAMES, actual, expected):
            if (name.startswith("dbranch") and case["num_branch"] == 0) or (name == "dsinks" and not case["sinks"]):
                assert got is None and want is None, name
                continue
            assert got.dtype == dtype, name
            torch.testing.assert_close(
                got, local(name, want).to(dtype), **tolerance, msg=lambda m, n=name, c=case: f"{n} {c}: {m}"
            )
    return local_index.numel()


def check_query_index_cases(size: int, mode: str, cases_per_group: list[list[dict]]) -> list[int]:
    group = subgroup(size)
    counts = []
    for case in cases_per_group[dist.get_rank() // size]:
        for dtype in (torch.float64, torch.float32):
            counts.append(check_query_index_case(case, dtype, group, mode))
    return counts


@pytest.mark.parametrize("mode", CP_MODES)
@pytest.mark.parametrize("world_size", [2, 4])
def test_query_index_matches_reference_rows(cp_pool, world_size, mode):
    """`query_index` on zigzag shards (DFlash's anchors, the TTT's later steps): packed documents, sliding windows,
    sinks, branches, odd and empty local query sets, forward and backward."""
    num_groups = POOL_WORLD_SIZE // world_size
    cases_per_group = [
        [random_case(3000 * world_size + 10 * group + index, world_size) for index in range(8 // num_groups + 2)]
        for group in range(num_groups)
    ]
    counts = cp_pool.run(check_query_index_cases, world_size, mode, cases_per_group)
    flat = [count for per_rank in counts for count in per_rank]
    assert 0 in flat and any(count % 2 for count in flat), counts  # empty and odd local query sets were covered


def check_bfloat16(size: int) -> float:
    """The worst relative error of bf16 against float64; also checks that autocast changes nothing."""
    group = subgroup(size)
    rank = dist.get_rank(group)
    case = {**random_case(5, size), "num_branch": 2, "doc_lengths": [8, 16, 24], "batch_size": 1, "length": 48}
    inputs = make_inputs({**case, "sinks": False}, torch.bfloat16)
    del inputs["sinks"]
    cu_seqlens = cu_seqlens_of(case)
    upstream = torch.randn(inputs["q"].shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    exact = {name: t.double() for name, t in inputs.items()}
    expected = outputs_and_grads(branch_attention_reference, exact, upstream, cu_seqlens=cu_seqlens)
    shards = {
        name: zigzag_shard(t, 3 if name.startswith("branch") else 2, rank, size, cu_seqlens)
        for name, t in inputs.items()
    }
    upstream_shard = zigzag_shard(upstream, 2, rank, size, cu_seqlens)
    ring = lambda **kw: branch_attention(**kw, cp_group=group, block_size=4)  # noqa: E731
    actual = outputs_and_grads(ring, shards, upstream_shard, cu_seqlens=cu_seqlens)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed-precision training: the kernel keeps its own dtype
        under_autocast = outputs_and_grads(ring, shards, upstream_shard, cu_seqlens=cu_seqlens)
    worst = 0.0
    for index, (got, want) in enumerate(zip(actual, expected)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(under_autocast[index], got, rtol=0, atol=0)
        want = zigzag_shard(want, 3 if index >= 4 else 2, rank, size, cu_seqlens)
        worst = max(worst, float((got.double() - want).norm() / want.norm()))
    return worst


def test_bfloat16_close_to_float64(cp_pool):
    errors = cp_pool.run(check_bfloat16, 2)
    assert max(errors) < 1e-2, errors


def count_block_pairs(mode: str, window: int | None) -> tuple[int, int, int, int, int]:
    """Blocks computed by the ring on one document cut into 2W chunks of one block each, and by one device; and the
    ring's communication rounds."""
    group = subgroup(POOL_WORLD_SIZE)
    rank, world_size = dist.get_rank(group), POOL_WORLD_SIZE
    chunk = 4
    case = {**random_case(3, world_size), "num_q_heads": 2, "num_kv_heads": 1, "num_branch": 1}
    case.update(batch_size=1, doc_lengths=None, length=2 * world_size * chunk, branch_as_none=False, sinks=False)
    inputs = make_inputs(case, torch.float64)
    del inputs["sinks"]
    counts = {"forward": 0, "backward": 0, "rounds": 0}
    originals = blockwise.block_forward, blockwise.block_backward, RingComm.commit

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    blockwise.block_forward, blockwise.block_backward, RingComm.commit = (
        counting("forward", originals[0]),
        counting("backward", originals[1]),
        counting("rounds", originals[2]),
    )
    try:
        shards = {
            name: zigzag_shard(t, 3 if name.startswith("branch") else 2, rank, world_size)
            for name, t in inputs.items()
        }
        upstream = torch.ones_like(shards["q"])
        attention = context_parallel_attention(group, mode)
        outputs_and_grads(attention, shards, upstream, block_size=chunk, sliding_window=window)
        ring_counts = counts["forward"], counts["backward"], counts["rounds"]
        counts.update(forward=0, backward=0)
        outputs_and_grads(
            branch_attention, inputs, torch.ones_like(inputs["q"]), block_size=chunk, sliding_window=window
        )
        single_counts = counts["forward"], counts["backward"]
    finally:
        blockwise.block_forward, blockwise.block_backward, RingComm.commit = originals
    return (*ring_counts, *single_counts)


@pytest.mark.parametrize("mode", CP_MODES)
@pytest.mark.parametrize("window", [None, 3])
def test_invisible_chunks_are_skipped(cp_pool, mode, window):
    """Full causal, per rank: its 3 local (query chunk, key chunk) pairs, then 2 per other rank (an earlier rank's
    first chunk is seen by both query chunks, a later rank's chunks only by the late query chunk): 2W + 1, never 4W.
    A window shorter than a chunk: each query chunk and the one before it (3 on rank 0, 4 elsewhere), and the ring
    runs steps 0, 1 and W - 1 only, hopping over the others. Summed over the ranks this is exactly the single-device
    count; also when the queries travel instead ("gather_queries": each rank runs every query against its own keys)."""
    counts = cp_pool.run(count_block_pairs, mode, window)
    num_blocks = 2 * POOL_WORLD_SIZE
    steps = ring_steps(POOL_WORLD_SIZE, window, length=num_blocks * 4)
    assert steps == (list(range(POOL_WORLD_SIZE)) if window is None else [0, 1, POOL_WORLD_SIZE - 1])
    for rank, (forward, backward, rounds, _, _) in enumerate(counts):
        if mode != "gather_queries":
            assert forward == backward == (2 * POOL_WORLD_SIZE + 1 if window is None else 3 + (rank > 0))
        # forward and backward K/V hops, and the dK/dV's hops home; the all-gathers have no rounds
        assert rounds == (3 * (len(steps) - 1) + 1 if mode == "ring" else 0)
    single_forward = counts[0][3]
    assert single_forward == (num_blocks * (num_blocks + 1) // 2 if window is None else 2 * num_blocks - 1)
    assert sum(forward for forward, *_ in counts) == single_forward
    assert sum(backward for _, backward, *_ in counts) == counts[0][4]


def ring_comm_protocol() -> list[float]:
    group = subgroup(2)
    rank = dist.get_rank(group)
    comm = RingComm(group)
    with pytest.raises(RuntimeError, match="nothing queued"):
        comm.commit()
    with pytest.raises(RuntimeError, match="without a committed round"):
        comm.wait()
    with pytest.raises(RuntimeError, match="contiguous"):
        comm.send_recv(torch.zeros(4, 2).t())
    sent = torch.full((3,), 10.0 * dist.get_rank() + rank)
    received = comm.send_recv(sent)
    comm.commit()
    with pytest.raises(RuntimeError, match="in flight"):
        comm.send_recv(sent)
    with pytest.raises(RuntimeError, match="twice"):
        comm.commit()
    comm.wait()
    # A second round on the same object works (the protocol resets after wait).
    again = comm.send_recv(sent + 1)
    comm.commit()
    comm.wait()
    assert torch.equal(again, received + 1)
    return received.tolist()


def test_ring_comm_protocol(cp_pool):
    received = cp_pool.run(ring_comm_protocol)
    # Ranks 0,1 form one ring and 2,3 another; rank r sent 10 r + (its rank in the ring) to its neighbour.
    assert received == [[11.0] * 3, [0.0] * 3, [31.0] * 3, [20.0] * 3]


def invalid_inputs(mode: str) -> None:
    group = subgroup(2)
    q = torch.randn(1, 2, 6, 4)
    k = v = torch.randn(1, 1, 6, 4)
    with pytest.raises(ValueError, match=r"multiple of 2 \* world_size = 4 .* got length 6 for document 1"):
        branch_attention(q, k, v, cu_seqlens=torch.tensor([0, 4, 10, 12]), cp_group=group, cp_mode=mode)
    with pytest.raises(ValueError, match=r"end at the sequence length L=12, got first=0 and last=6"):
        branch_attention(q, k, v, cu_seqlens=torch.tensor([0, 6]), cp_group=group, cp_mode=mode)  # a local cu_seqlens
    with pytest.raises(ValueError, match=r"need batch size B=1, got B=2"):
        branch_attention(
            q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
            cu_seqlens=torch.tensor([0, 12]), cp_group=group, cp_mode=mode,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"strictly increasing positions in \[0, 6\)"):  # local, not global
        branch_attention(q[:, :, :1], k, v, cp_group=group, cp_mode=mode, query_index=torch.tensor([6]))
    with pytest.raises(ValueError, match=r"Hq=3 must be a multiple"):
        k2 = torch.randn(1, 2, 6, 4)
        branch_attention(torch.randn(1, 3, 6, 4), k2, k2, cp_group=group, cp_mode=mode)


@pytest.mark.parametrize("mode", CP_MODES)
def test_invalid_inputs_raise_on_every_rank(cp_pool, mode):
    cp_pool.run(invalid_inputs, mode)
