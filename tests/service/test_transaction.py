"""`service.core.transaction`: a launch applies to every slot it touches or leaves each as
it was. The module on a pool layer by itself, then `ServerCore` with a kernel that fails
after writing the pool (a fault injected around the real kernel): every slot comes back
bit for bit, none is flagged, and the next prefill runs from the old states. On the CPU,
and on the GPU where there is one (marked ``gpu``)."""
from __future__ import annotations

import asyncio
from typing import Any, Optional

import pytest
import torch
from server_harness import HV, K, LAYERS, TOL, V, make_sequence, reference, rel

import service.core.server as server_module
from kernels.problem import PrefillProblem
from service.config import Settings
from service.core.inputs import PrefillInputs, PrefillParams
from service.core.server import ServerCore
from service.core.transaction import LaunchFailed, LaunchTransaction, MovedRows, UpdateDiverged

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="needs a CUDA device")]),
]


def _layer(device: str, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(8, HV, V, K, generator=gen).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_a_diverged_sequence_rolls_back_its_whole_request_only(device: str, gen: torch.Generator) -> None:
    """Requests of 2, 1 and 2 sequences on rows [5, 1 | 6 | 0, 3]: the kernel's writes kept
    for the requests whose sequences are finite, every row of the request with a flagged
    sequence (its own flag, or the unattributed one and a NaN in its tokens of o) written
    back as it was."""
    layer = _layer(device, gen)
    before = layer.clone()
    indices = torch.tensor([5, 1, 6, 0, 3], device=device)
    requests = [([3, 2], ["a", None]), ([4], ["c"]), ([1, 2], ["d", "e"])]
    txn = LaunchTransaction(layer, indices, requests)
    assert txn.flags.tolist() == [0] * 6 and txn.flags.device == layer.device
    layer[indices] += 1.0  # the kernel's update
    updated = layer.clone()
    txn.flags[3] = 1  # sequence 3 (request 2's first) diverged, as the state pass flags it
    o = torch.randn(12, HV, V, device=device)
    o[3, 1, 0] = float("inf")  # token 3: sequence 1 (request 0's second) diverged in o ...
    txn.flags[5] = 1  # ... flagged by a stage that does not know whose
    refused = txn.settle(o)
    assert sorted(refused) == [0, 2]
    assert isinstance(refused[0], UpdateDiverged) and refused[0].sequences == [1]
    assert refused[2].sequences == [0] and "slot 'd'" in refused[2].detail
    for row in (5, 1, 0, 3):
        assert torch.equal(layer[row], before[row])
    assert torch.equal(layer[6], updated[6])
    assert torch.equal(layer[[2, 4, 7]], before[[2, 4, 7]])  # rows of no sequence: never touched


@pytest.mark.parametrize("device", DEVICES)
def test_a_clean_launch_keeps_every_update(device: str, gen: torch.Generator) -> None:
    """No flag set: every update stands, even with a NaN in o (the kernels' flags decide,
    o is not read again)."""
    layer = _layer(device, gen)
    indices = torch.tensor([2, 7], device=device)
    txn = LaunchTransaction(layer, indices, [([1], [None]), ([64], ["x"])])
    layer[indices] *= 0.5
    updated = layer.clone()
    o = torch.randn(65, HV, V, device=device)
    o[0, 0, 0] = float("nan")
    assert txn.settle(o) == {}
    assert torch.equal(layer, updated)


@pytest.mark.parametrize("device", DEVICES)
def test_the_real_kernels_flag_what_the_transaction_rolls_back(device: str, gen: torch.Generator) -> None:
    """`kernels.run_problem` with the transaction's flags: a sequence with one NaN in its v
    (as an overflow inside the kernel leaves) is flagged and rolled back; its neighbour
    keeps its update."""
    from kernels import run_problem
    from kernels.problem import packed_problem

    T, H = 80, HV
    layer = _layer(device, gen) * 0.1
    before = layer.clone()
    indices = torch.tensor([3, 6], device=device)
    txn = LaunchTransaction(layer, indices, [([16], ["a"]), ([64], ["b"])])
    q, k = (torch.randn(T, H, K, generator=gen).to(device) for _ in range(2))
    v = torch.randn(T, HV, V, generator=gen).to(device)
    v[7, 1, 2] = float("nan")  # sequence 0
    g = -torch.rand(T, HV, K, generator=gen).to(device)
    beta = torch.rand(T, HV, generator=gen).to(device)
    problem = packed_problem(q, k, v, g, beta, bounds=[0, 16, 80], pool=layer, indices=indices, scale=None,
                             A_log=None, dt_bias=None, lower_bound=None, use_qk_l2norm=True,
                             use_beta_sigmoid=False, allow_neg_eigval=False, nonfinite=txn.flags)
    o, _ = run_problem(problem)
    updated = layer.clone()
    refused = txn.settle(o)
    assert list(refused) == [0] and refused[0].sequences == [0]
    assert torch.equal(layer[3], before[3]) and torch.equal(layer[6], updated[6])
    assert not torch.equal(layer[6], before[6]) and torch.isfinite(layer[6]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_one_read_brings_back_the_flags_and_the_input_check(device: str, gen: torch.Generator) -> None:
    """With ``checks_inputs`` the problem's ``input_checks`` shares the flags' buffer: after a
    launch with a positive log decay in g (sequence 0, a failed input check) and a NaN in
    v (sequence 1), one `read` returns the sequence's flag and the failed check, and
    `settle` takes the flags read; a clean launch reads no failure."""
    from kernels import run_problem
    from kernels.problem import packed_problem

    T, H = 80, HV
    for poisoned in (False, True):
        layer = _layer(device, gen) * 0.1
        indices = torch.tensor([3, 6], device=device)
        txn = LaunchTransaction(layer, indices, [([16], ["a"]), ([64], ["b"])], checks_inputs=True)
        assert txn.input_checks is not None and txn.input_checks.tolist() == [0]
        q, k = (torch.randn(T, H, K, generator=gen).to(device) for _ in range(2))
        v = torch.randn(T, HV, V, generator=gen).to(device)
        g = -torch.rand(T, HV, K, generator=gen).to(device)
        if poisoned:
            v[40, 1, 2] = float("nan")  # sequence 1
            g[5, 0, 3] = 0.375  # sequence 0: a growing state
        beta = torch.rand(T, HV, generator=gen).to(device)
        problem = packed_problem(q, k, v, g, beta, bounds=[0, 16, 80], pool=layer, indices=indices, scale=None,
                                 A_log=None, dt_bias=None, lower_bound=None, use_qk_l2norm=True,
                                 use_beta_sigmoid=False, allow_neg_eigval=False, nonfinite=txn.flags,
                                 input_checks=txn.input_checks)
        o, _ = run_problem(problem)
        flags, failed = txn.read()
        assert (flags, failed) == (([0, 1, 0], True) if poisoned else ([0, 0, 0], False))
        assert list(txn.settle(o, flags)) == ([1] if poisoned else [])


@pytest.mark.parametrize("device", DEVICES)
def test_each_read_brings_back_the_flags_as_they_are_now(device: str, gen: torch.Generator) -> None:
    """A prepared run's transaction is read once per run (on a GPU through the same
    page-locked copy): each `read` returns the flags and the check as the device holds
    them then, after work queued on the stream since the last read."""
    txn = LaunchTransaction(_layer(device, gen), torch.tensor([1, 4], device=device), [([3, 5], ["a", "b"])],
                            checks_inputs=True)
    assert txn.read() == ([0, 0, 0], False)
    txn.flags[1] = 7  # queued on the stream, as a launch's flag would be
    assert txn.read() == ([0, 7, 0], False)
    txn.input_checks.fill_(1)
    txn.flags.zero_()
    assert txn.read() == ([0, 0, 0], True)


class _Moves:
    """A stand-in for the pool's side of `MovedRows`: the positions committed and given back."""

    def __init__(self, written: torch.Tensor) -> None:
        self.committed: list[list[int]] = []
        self.given_back: list[list[int]] = []
        self.rows = MovedRows(written.tolist(), written, self.committed.append, self.given_back.append)


@pytest.mark.parametrize("device", DEVICES)
def test_moved_rows_commit_the_standing_requests_and_write_nothing_back(device: str,
                                                                        gen: torch.Generator) -> None:
    """With spare rows: the launch writes its new states to rows [2, 4, 7] and reads rows
    [5, 1, 6]; request 0's sequence 1 diverged, so `finish` commits request 1's sequence (2)
    and gives back request 0's two spares (0, 1); no row is copied or written back, and a
    second `finish` does nothing."""
    layer = _layer(device, gen)
    moves = _Moves(torch.tensor([2, 4, 7], device=device))
    txn = LaunchTransaction(layer, torch.tensor([5, 1, 6], device=device), [([3, 2], ["a", "b"]), ([4], ["c"])],
                            moved=moves.rows)
    assert txn.saved is None and txn.write_indices is moves.rows.written and txn.written is moves.rows.written
    layer[moves.rows.written] += 1.0  # the kernel's writes
    after_kernel = layer.clone()
    txn.flags[1] = 1
    refused = txn.settle(torch.randn(9, HV, V, device=device))
    assert sorted(refused) == [0] and refused[0].sequences == [1]
    txn.finish()
    assert moves.committed == [[2]] and moves.given_back == [[0, 1]]
    assert torch.equal(layer, after_kernel)  # nothing written back: the rows read were never written
    txn.finish()
    assert moves.committed == [[2]] and moves.given_back == [[0, 1]]


@pytest.mark.parametrize("device", DEVICES)
def test_moved_rows_abort_commits_nothing_and_gives_every_spare_back(device: str, gen: torch.Generator) -> None:
    layer = _layer(device, gen)
    moves = _Moves(torch.tensor([3, 6], device=device))
    txn = LaunchTransaction(layer, torch.tensor([4, 0], device=device), [([2, 3], [None, "s"])], moved=moves.rows)
    flagged: list[bool] = []
    error = txn.abort(RuntimeError("kernel fault"), lambda: flagged.append(True))
    assert error.restored and not flagged
    assert moves.committed == [] and moves.given_back == [[0, 1]]


@pytest.mark.parametrize("device", DEVICES)
def test_abort_restores_every_row_and_flags_nothing(device: str, gen: torch.Generator) -> None:
    layer = _layer(device, gen)
    before = layer.clone()
    indices = torch.tensor([4, 0], device=device)
    txn = LaunchTransaction(layer, indices, [([2, 3], [None, "s"])])
    layer[indices] = float("nan")
    flagged: list[bool] = []
    error = txn.abort(RuntimeError("kernel fault"), lambda: flagged.append(True))
    assert isinstance(error, LaunchFailed) and error.restored and error.status == 500
    assert torch.equal(layer, before) and not flagged


@pytest.mark.parametrize("device", DEVICES)
def test_rows_the_launch_saves_restore_only_a_launch_that_started(device: str, gen: torch.Generator) -> None:
    """``saved_by_launch``: the launch fills `saved` as it reads the rows (here by hand), so
    a launch that started is written back from it, and one that never started wrote no row
    and its rows stay as they are (`saved` holds nothing then: NaN here)."""
    layer = _layer(device, gen)
    before = layer.clone()
    indices = torch.tensor([4, 0], device=device)
    txn = LaunchTransaction(layer, indices, [([1, 1], ["s", "t"])], saved_by_launch=True)
    assert txn.saved.shape == (2, HV, V, K)
    txn.saved.fill_(float("nan"))
    error = txn.abort(RuntimeError("graph replay refused"), lambda: None, started=False)
    assert error.restored and torch.equal(layer, before)
    txn.saved.copy_(layer[indices])  # what the launch saves as it reads
    layer[indices] = float("nan")  # and then writes
    txn.abort(RuntimeError("kernel fault"), lambda: None, started=True)
    assert torch.equal(layer, before)


def test_abort_flags_the_slots_when_even_the_restore_fails(gen: torch.Generator) -> None:
    layer = _layer("cpu", gen)
    txn = LaunchTransaction(layer, torch.tensor([1]), [([2], ["s"])])
    txn.saved = torch.empty(0)  # a restore that cannot run (as on a GPU whose context is gone)
    flagged: list[bool] = []
    error = txn.abort(RuntimeError("kernel fault"), lambda: flagged.append(True))
    assert flagged == [True] and not error.restored and "state_lost" in error.detail


def _failing_kernel(real: Any) -> Any:
    def run(problem: PrefillProblem, backend: Optional[str] = None) -> Any:
        real(problem, backend)  # writes the rows it writes: in place, or spare rows
        written = problem.indices if problem.write_indices is None else problem.write_indices
        problem.pool[written] = float("nan")  # and leaves garbage there
        raise RuntimeError("injected kernel failure")
    return run


@pytest.mark.parametrize("spare_rows", [None, 0], ids=["spare rows", "in place"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_launch_restores_its_slots_in_the_server(device: str, spare_rows: Optional[int],
                                                          gen: torch.Generator,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(device=device, num_layers=LAYERS, num_slots=4, num_heads=HV, head_dim=K, head_v_dim=V,
                        batch_window_ms=0, spare_rows=spare_rows)
    first, second = make_sequence(9, gen), make_sequence(70, gen)

    def prefill_inputs(slot: str, seq: tuple[torch.Tensor, ...]) -> PrefillInputs:
        tensors = dict(zip(("q", "k", "v", "g", "beta"), seq))
        return PrefillInputs.of(PrefillParams(layer=0), [slot], [seq[0].shape[0]], tensors)

    async def main() -> tuple[torch.Tensor, torch.Tensor, LaunchFailed, Any, Any]:
        core = ServerCore(settings)
        await core.start()
        try:
            slot = (await core.alloc())[0]
            await core.prefill(prefill_inputs(slot, first))
            before = await core.get_state(slot)
            real = server_module.kernels.run_problem
            monkeypatch.setattr(server_module.kernels, "run_problem", _failing_kernel(real))
            with pytest.raises(LaunchFailed) as failed:
                await core.prefill(prefill_inputs(slot, second))
            monkeypatch.setattr(server_module.kernels, "run_problem", real)
            after = await core.get_state(slot)
            info = await core.slot_info(slot)
            assert core.pool.free_spare_rows == core.pool.spare_rows
            result = await core.prefill(prefill_inputs(slot, second))
            return before, after, failed.value, info, result
        finally:
            await core.close()

    before, after, failed, info, result = asyncio.run(main())
    assert failed.restored and "injected kernel failure" in failed.detail
    assert torch.equal(before, after) and not info.state_lost
    assert info.tokens_per_layer == [9, 0]  # the failed launch counted no token
    o1, h1 = reference([first])
    o2, h2 = reference([second], initial=h1)
    assert rel(result.o, o2) < TOL and rel(result.final_state, h2) < TOL


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_launch_stores_no_checkpoint(device: str, gen: torch.Generator,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel writes its checkpoints straight into the prefix cache's entries, then the
    launch fails: none is stored. A new key stays absent, an entry's layer written in place
    stays unstored, a key's entry at another offset stays as it was; the same prefill run
    again stores them all."""
    from service.core.inputs import Checkpoint
    from service.errors import UnknownPrefix

    settings = Settings(device=device, num_layers=LAYERS, num_slots=6, num_heads=HV, head_dim=K, head_v_dim=V,
                        batch_window_ms=0)
    first = [make_sequence(64, gen) for _ in range(LAYERS)]
    b_seq, c_seq = make_sequence(128, gen), make_sequence(64, gen)

    def inputs(layer: int, slots: list[Optional[str]], seqs: list[tuple[torch.Tensor, ...]],
               marks: list[list[tuple[int, str]]]) -> PrefillInputs:
        tensors = {name: torch.cat([s[i] for s in seqs]) for i, name in enumerate(("q", "k", "v", "g", "beta"))}
        return PrefillInputs.of(PrefillParams(layer=layer), slots, [s[0].shape[0] for s in seqs], tensors,
                                checkpoints=[[Checkpoint(o, key) for o, key in m] for m in marks])

    async def main() -> None:
        core = ServerCore(settings)
        await core.start()
        try:
            a, a2, b = await core.alloc(3)
            await core.prefill(inputs(0, [a, a2], [first[0], first[0]], [[(64, "part")], [(64, "old")]]))
            await core.prefill(inputs(1, [a2], [first[1]], [[(64, "old")]]))
            old = (await core.prefix_state("old"))[0]
            again = inputs(1, [b, None], [b_seq, c_seq], [[(64, "part"), (128, "old")], [(64, "fresh")]])
            (part_entry,) = [e for e in core.prefix_cache.entries() if e.key == "part"]
            unstored = part_entry.state[1].clone()
            real = server_module.kernels.run_problem
            monkeypatch.setattr(server_module.kernels, "run_problem", _failing_kernel(real))
            with pytest.raises(LaunchFailed):
                await core.prefill(again)
            monkeypatch.setattr(server_module.kernels, "run_problem", real)
            assert not torch.equal(part_entry.state[1], unstored)  # the kernel did write the entry in place
            with pytest.raises(UnknownPrefix):
                await core.prefix_info("fresh")
            part = await core.prefix_info("part")
            assert (part.layers, part.complete) == (1, False)
            assert (await core.prefix_info("old")).tokens == 64
            assert torch.equal((await core.prefix_state("old"))[0], old)

            await core.prefill(again)  # the same prefill, launched for real, stores them all
            assert (await core.prefix_info("part")).complete
            assert ((await core.prefix_info("old")).tokens, (await core.prefix_info("fresh")).layers) == (128, 1)
            restored, _ = await core.alloc_prefix(["part"])
            state = await core.get_state(restored[0])
            _, h0 = reference([first[0]])
            _, h1 = reference([tuple(t[:64] for t in b_seq)])
            assert rel(state[0], h0[0]) < TOL and rel(state[1], h1[0]) < TOL
        finally:
            await core.close()

    asyncio.run(main())


def _failing_before_the_kernel(problem: PrefillProblem, backend: Optional[str] = None) -> Any:
    raise RuntimeError("injected failure before the kernel ran")


def _one_entry_settings(device: str) -> Settings:
    """A server whose prefix cache has room for one entry, and no host tier."""
    return Settings(device=device, num_layers=LAYERS, num_slots=4, num_heads=HV, head_dim=K, head_v_dim=V,
                    batch_window_ms=0, prefix_cache_mb=LAYERS * HV * V * K * 4 / 2**20)


def _checkpointed(slot: str, seq: tuple[torch.Tensor, ...], key: str) -> PrefillInputs:
    """Layer 0 of ``slot`` prefilled with ``seq``, a checkpoint ``key`` at its end."""
    from service.core.inputs import Checkpoint

    tensors = dict(zip(("q", "k", "v", "g", "beta"), seq))
    end = seq[0].shape[0]
    return PrefillInputs.of(PrefillParams(layer=0), [slot], [end], tensors, checkpoints=[[Checkpoint(end, key)]])


async def _core_holding_one_entry(device: str) -> tuple[ServerCore, str]:
    """A started core whose prefix cache holds one entry, "held" (all its budget takes),
    and a fresh slot."""
    core = ServerCore(_one_entry_settings(device))
    await core.start()
    held, slot = await core.alloc(2)
    await core.publish(held, "held")
    return core, slot


@pytest.mark.parametrize("device", DEVICES)
def test_a_launch_failing_before_the_kernel_asked_for_its_checkpoints_places_none(
        device: str, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoints' places in the prefix cache are made when the kernel first asks for
    them (`PrefillProblem.checkpoint_provider`): a launch that fails before makes no room
    for its new entry, so the one entry the budget holds stays, nothing is evicted."""
    from service.errors import UnknownPrefix

    async def main() -> None:
        core, slot = await _core_holding_one_entry(device)
        try:
            monkeypatch.setattr(server_module.kernels, "run_problem", _failing_before_the_kernel)
            with pytest.raises(LaunchFailed):
                await core.prefill(_checkpointed(slot, make_sequence(64, gen), "fresh"))
            assert core.prefix_cache.evictions() == {"device": 0, "host": 0}
            assert (await core.prefix_info("held")).tier == "device"
            with pytest.raises(UnknownPrefix):
                await core.prefix_info("fresh")
        finally:
            await core.close()

    asyncio.run(main())


@pytest.mark.parametrize("device", DEVICES)
def test_a_launch_failing_after_the_kernel_placed_its_checkpoints_releases_them(
        device: str, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel asks for its checkpoint's place (a new entry: room made by evicting the one
    entry the budget holds), writes it, and the launch fails: nothing is stored, and the
    placement is released, so the same prefill run again stores its entry in that room."""
    from service.errors import UnknownPrefix

    async def main() -> None:
        core, slot = await _core_holding_one_entry(device)
        try:
            request = _checkpointed(slot, make_sequence(64, gen), "fresh")
            real = server_module.kernels.run_problem
            monkeypatch.setattr(server_module.kernels, "run_problem", _failing_kernel(real))
            with pytest.raises(LaunchFailed):
                await core.prefill(request)
            monkeypatch.setattr(server_module.kernels, "run_problem", real)
            assert core.prefix_cache.evictions()["device"] == 1  # the kernel asked: room was made for "fresh"
            for key in ("held", "fresh"):
                with pytest.raises(UnknownPrefix):
                    await core.prefix_info(key)
            await core.prefill(request)
            fresh = await core.prefix_info("fresh")
            assert (fresh.tier, fresh.layers, fresh.tokens) == ("device", 1, 64)
        finally:
            await core.close()

    asyncio.run(main())


@pytest.mark.parametrize("spare_rows", [None, 0], ids=["spare rows", "in place"])
@pytest.mark.parametrize("device", DEVICES)
def test_inputs_failing_the_kernels_check_are_refused_after_the_launch_and_change_nothing(
        device: str, spare_rows: Optional[int], gen: torch.Generator) -> None:
    """Two requests in one launch, the first with a NaN in q, their values left to the
    kernels (`validate_prefill` with ``defer``: no 400 before the launch): the first gets
    its 400 naming q, its slot is bit for bit as before and counts no token, its checkpoint
    is not stored; the second stands, as the reference says."""
    from service.core.server import _Job
    from service.core.validation import validate_prefill
    from service.errors import InvalidRequest

    core = ServerCore(Settings(device=device, num_layers=LAYERS, num_slots=4, num_heads=HV, head_dim=K,
                               head_v_dim=V, batch_window_ms=0, spare_rows=spare_rows))
    slots = core._alloc(2)
    for slot in slots:
        core._write_state(slot, (torch.randn(LAYERS, HV, V, K, generator=gen) * 0.3).to(device))
    before = [core.pool.read_state(s).cpu().clone() for s in slots]
    names = ("q", "k", "v", "g", "beta")
    bad, good = list(make_sequence(5, gen)), make_sequence(3, gen)
    bad[0][2, 0, 0] = float("nan")
    jobs = []
    for slot, seq in ((slots[0], bad), (slots[1], good)):
        x = PrefillInputs.of(PrefillParams(layer=0), [slot], [seq[0].shape[0]],
                             dict(zip(names, (t.to(device) for t in seq))))
        valid = validate_prefill(x, core.geometry, core.gates, defer=True)  # the NaN: no 400 yet
        assert valid.kernel_checked and valid.deferred is None
        end = seq[0].shape[0]
        jobs.append(_Job(valid, [slot], [], [(end, "bad" if seq is bad else "good", end)]))  # a checkpoint at its end
    outcomes = core._run_batch(jobs)
    assert core.prefix_cache.info("bad") is None  # the refused request's checkpoint was not stored ...
    assert core.prefix_cache.info("good").layers == 1  # ... its neighbour's was
    assert isinstance(outcomes[0], InvalidRequest) and outcomes[0].field == "q" and "non-finite" in outcomes[0].detail
    assert not isinstance(outcomes[1], BaseException)
    assert torch.equal(core.pool.read_state(slots[0]).cpu(), before[0])
    assert not torch.equal(core.pool.read_state(slots[1]).cpu(), before[1])
    assert core.pool.slot_info(slots[0]).tokens_per_layer == [0, 0]
    assert core.pool.slot_info(slots[1]).tokens_per_layer == [3, 0]
    assert core.pool.free_spare_rows == core.pool.spare_rows  # the refused request's spare row went back, the other's old row too
    o2, h2 = reference([good], initial=before[1][0:1])
    assert rel(outcomes[1].o, o2) < TOL


def test_a_failed_input_check_no_scan_confirms_refuses_every_request_it_checked(gen: torch.Generator) -> None:
    """`ServerCore._refuse_values` when the launch's check failed but every request's
    values scan clean (inputs read in place, changed during the launch): each request the
    kernels checked is rolled back and refused 400 (field ``inputs``); one whose values
    validation scanned itself is not."""
    from service.core.server import _Job
    from service.core.validation import validate_prefill
    from service.errors import InvalidRequest

    core = ServerCore(Settings(device="cpu", num_layers=LAYERS, num_slots=4, num_heads=HV, head_dim=K, head_v_dim=V,
                               spare_rows=0))  # rows updated in place, copied first
    slots = core._alloc(3)
    layer = core.pool.storage
    layer.copy_(torch.randn_like(layer))
    before = layer.clone()
    jobs = []
    for i, slot in enumerate(slots):
        seq = make_sequence(2, gen)
        x = PrefillInputs.of(PrefillParams(layer=0), [slot], [2], dict(zip(("q", "k", "v", "g", "beta"), seq)))
        jobs.append(_Job(validate_prefill(x, core.geometry, core.gates, defer=i < 2), [slot], [], []))
    assert [job.valid.kernel_checked for job in jobs] == [True, True, False]
    rows = torch.tensor(core.pool.layer_rows(0, core.pool.rows(slots)))
    txn = LaunchTransaction(layer, rows, [(job.valid.inputs.lengths, job.valid.inputs.slots) for job in jobs],
                            checks_inputs=True)
    layer[rows] += 1.0  # the launch's writes
    refused = ServerCore._refuse_values(jobs, txn)
    assert sorted(refused) == [0, 1]
    assert all(isinstance(e, InvalidRequest) and e.field == "inputs" and "changed during the run" in e.detail
               for e in refused.values())
    assert torch.equal(layer[rows[:2]], before[rows[:2]]) and torch.equal(layer[rows[2]], before[rows[2]] + 1.0)
